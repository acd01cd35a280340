#!/usr/bin/env python
"""A Ray cluster of several nodes on this one machine, each node with GPUs of its own, to run the async script across
nodes where one multi-GPU host is at hand (``benchmarks/gpu_suite.sh`` part ``cluster``):

    python scripts/local_ray_cluster.py --nodes 0,1 2,3 --address-file /tmp/ray_address &
    python grpo/grpo-async.py ... ray.address=$(cat /tmp/ray_address)

Each node is a raylet of Ray's own test cluster (``ray.cluster_utils.Cluster``) started under
``CUDA_VISIBLE_DEVICES=<its GPUs>``, so it declares those GPUs alone and Ray names them as a node of their own would;
the first node is the head, where the script runs (its rank 0 trains on one of the head's GPUs). The nodes share the
machine's CPUs. Runs until SIGTERM or Ctrl-C, then stops every node.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ray.cluster_utils import Cluster  # noqa: E402

from grpo.process.ray_placement import MEMORY_MONITOR  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", nargs="+", required=True, help="each node's GPUs, e.g. 0,1 2,3 (the first: the head)")
    p.add_argument("--cpus", type=int, default=4, help="CPUs each node declares")
    p.add_argument("--object-store-gb", type=float, default=8, help="each node's object store (Ray's test default, "
                   "300 MB, spilled a 0.5B model's weight pushes to disk)")
    p.add_argument("--address-file", required=True, help="written with the cluster's address once every node is up")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ[MEMORY_MONITOR] = "0"  # as a run's own Ray: no actor killed for the whole machine's memory
    cluster = None
    stopped = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopped.set())
    try:
        for index, gpus in enumerate(args.nodes):
            os.environ["CUDA_VISIBLE_DEVICES"] = gpus  # the raylet, and every actor it starts, inherits it
            options = {"num_cpus": args.cpus, "num_gpus": len(gpus.split(",")), "include_dashboard": False,
                       "object_store_memory": int(args.object_store_gb * 2**30)}
            if index == 0:
                cluster = Cluster(initialize_head=True, head_node_args=options)
            else:
                cluster.add_node(**{k: v for k, v in options.items() if k != "include_dashboard"})
        cluster.wait_for_nodes()
        Path(args.address_file).write_text(cluster.address)
        print(f"Ray cluster at {cluster.address}: nodes with GPUs {' | '.join(args.nodes)}", flush=True)
        stopped.wait()
    finally:
        if cluster is not None:
            cluster.shutdown()


if __name__ == "__main__":
    main()
