"""The run both scripts share: config checks, start, the loop and its crash policy, evaluation, logging, what a run
dir keeps."""
