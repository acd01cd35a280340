"""Every bad input of issue 20, one row each: what a user sets or feeds, through the entry point the
run uses, and what stops it: a ``UserError`` whose one-line message names the key or row and the fix,
or the warning that flags legal but degenerate data. A few go through the script itself, to prove
the user sees that one line and no traceback."""

import json
import os
import shutil
import signal
import subprocess
import sys
from fnmatch import fnmatch

import pytest
import torch
from torchrl.data.llm import History

from conftest import REPO, TINY_DATA, TINY_MODEL, compose, compose_in_run_dir
from grpo.export import export_checkpoint
from grpo.inference.decoding import ReplySampler
from grpo.inference.engine import make_inference, make_transformers_policy
from grpo.inference.generation import EngineSettings
from grpo.loop.config import validate_config, warn_if_too_few_rows
from grpo.loop.run import start_run
from grpo.process.errors import ConfigError, DataError, ExportError, ModelLoadError, ResumeError, UserError, clear_errors
from grpo.tasks.envs import load_gsm8k, load_splits, make_env, task_of
from grpo.tasks.ifeval import load_ifeval_rows
from grpo.tasks.prompt_checks import check_prompt_lengths
from grpo.tasks.settings import TaskSettings
from grpo.training.models import load_policy_model, load_tokenizer
from grpo.training.settings import ModelSettings

# A run small enough to build in-process in seconds (the resume and length checks run while it is built)
SMALL = [f"model.name={TINY_MODEL}", f"env.dataset={TINY_DATA}", "eval.num_problems=8", "eval.batch_size=8",
         "env.num_envs=16", "env.repeats=4", "train.dialog_turns_per_batch=16", "train.optim_batch_size=8",
         "logging.progress_bar=false"]
GOOD = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(16)]


def jsonl(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def gsm8k_folder(tmp, train):
    """A data folder whose train.jsonl is ``train`` (text, bytes, or rows) and test.jsonl is sound."""
    folder = tmp / "data"
    folder.mkdir(exist_ok=True)
    train = jsonl(train) if isinstance(train, list) else train
    (folder / "train.jsonl").write_bytes(train if isinstance(train, bytes) else train.encode())
    (folder / "test.jsonl").write_text(jsonl(GOOD))
    return folder


def build_run(run_dir, *overrides):
    """``start_run`` as the sync script calls it, in ``run_dir`` (hydra.run.dir)."""
    cfg = compose_in_run_dir(run_dir, [*SMALL, *overrides])
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return start_run(cfg, inference_engines=1, dedicated_inference=False)
    finally:  # start_run claims SIGINT/SIGTERM; give them back to pytest
        for s, handler in handlers.items():
            signal.signal(s, handler)


@pytest.fixture(scope="module")
def made_run(tmp_path_factory):
    """A run dir holding a real checkpoint (of the tiny model), as a finished run leaves it."""
    run_dir = tmp_path_factory.mktemp("made_run")
    run = build_run(run_dir)
    run.checkpoint_if_due(dict, force=True)
    run.engine.shutdown()
    run.records.logger.close(0)
    return run_dir


def copy_checkpoint_files(made_run, into):
    into.mkdir(parents=True, exist_ok=True)
    for f in (made_run / "checkpoints").iterdir():
        shutil.copy(f, into / f.name)
    return into


class Context:
    """What a case may use: its tmp folder, monkeypatch, and (built once, on first use) ``made_run``."""

    def __init__(self, tmp, monkeypatch, request):
        self.tmp, self.monkeypatch, self.request = tmp, monkeypatch, request

    @property
    def made_run(self):
        return self.request.getfixturevalue("made_run")


# ------------------------------------------------------------------------------------------- the cases

def config(*overrides):
    return lambda ctx: validate_config(compose("grpo_tiny", list(overrides)))


def gsm8k_train(train):
    """The train split loaded as ``start_run`` loads it, and its size checked against one step's prompts."""
    def load(ctx):
        folder = gsm8k_folder(ctx.tmp, train)
        warn_if_too_few_rows(compose("grpo_tiny"), len(load_gsm8k(str(folder), "train")))
    return load


def ifeval_train(bad_row):
    def load(ctx):
        ok = {"key": 1, "prompt": "Write a poem.", "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}
        (ctx.tmp / "train.jsonl").write_text(jsonl([ok, {"key": 2, "prompt": "Write a poem.", **bad_row}]))
        load_ifeval_rows(str(ctx.tmp), "train")
    return load


def model_folder_without(pattern):
    def load(ctx):
        for f in TINY_MODEL.iterdir():
            if not fnmatch(f.name, pattern):
                shutil.copy(f, ctx.tmp / f.name)
        load_tokenizer(str(ctx.tmp))  # the first thing a run loads
    return load


def vllm_not_installed(ctx):
    ctx.monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_TARGET_DEVICE", "VLLM_CPU_KVCACHE_SPACE", "HF_HUB_OFFLINE"):
        ctx.monkeypatch.setenv(key, os.environ.get(key, ""))  # restored after: the engine sets them before importing
    cfg = compose("grpo_tiny", [f"model.name={TINY_MODEL}", "inference_model.backend=vllm"])
    tokenizer = load_tokenizer(cfg.model.name)
    make_inference(EngineSettings.from_config(cfg), None, tokenizer, torch.device("cpu"),
                   stop_ids=[tokenizer.eos_token_id])


LONG = GOOD[:1] + [{"question": "What is 1 + 1? " * 6700, "answer": "#### 2"}] + GOOD[1:]  # 100,500 characters


def long_question(ctx):
    build_run(ctx.tmp / "run", f"env.dataset={gsm8k_folder(ctx.tmp, LONG)}")


def resume_with_another_model(ctx):
    build_run(ctx.tmp / "run", f"resume={ctx.made_run}", f"model.name={ctx.request.getfixturevalue('real_model_dir')}")


def resume_a_foreign_payload(ctx):
    run_dir = ctx.tmp / "run"
    shutil.copytree(ctx.made_run, run_dir)
    for f in (run_dir / "checkpoints").glob("*.json"):  # valid JSON, holding something else
        f.write_text(json.dumps({"weights": [0.0, 1.0]}))
    build_run(ctx.tmp / "new", f"resume={run_dir}")


def used_run_dir(ctx):
    (ctx.tmp / "metrics.jsonl").write_text('{"step": 0, "event": "start"}\n')
    try:
        build_run(ctx.tmp)
    finally:
        assert (ctx.tmp / "metrics.jsonl").read_text() == '{"step": 0, "event": "start"}\n'


def resume_an_empty_folder(ctx):
    (ctx.tmp / "empty").mkdir()
    build_run(ctx.tmp / "run", f"resume={ctx.tmp / 'empty'}")


def resume_a_flat_folder(ctx):
    """Checkpoint files outside a run dir: the run would continue in (and truncate the metrics of) the parent."""
    (ctx.tmp / "metrics.jsonl").write_text('{"step": 7, "reward": 1.0}\n')
    flat = copy_checkpoint_files(ctx.made_run, ctx.tmp / "flat")
    try:
        build_run(ctx.tmp / "run", f"resume={flat}")
    finally:
        assert (ctx.tmp / "metrics.jsonl").read_text() == '{"step": 7, "reward": 1.0}\n'


REWARDS = """import math
def score(reply, answer): return float(answer.endswith(reply))
def needs_gold(reply, gold): return 0.0
def no_reply(prompt): return 0.0
def nan(reply): return math.nan
def text(reply): return "good"
def batch(reply): return [1.0]
batch.batched = True
"""


def generic_task(*overrides):
    """``env.task=generic`` over GOOD (question, answer) with reward functions from {tmp}/rewards.py, loaded
    as ``start_run`` loads it: the config checked, the splits read, the functions imported and checked."""
    def load(ctx):
        (ctx.tmp / "rewards.py").write_text(REWARDS)
        cfg = compose("grpo_tiny", [f"model.name={TINY_MODEL}", "env.task=generic", "env.prompt_key=question",
                                    f"env.dataset={gsm8k_folder(ctx.tmp, GOOD)}",
                                    *[o.format(tmp=ctx.tmp) for o in overrides]])
        validate_config(cfg)
        load_splits(TaskSettings.from_config(cfg))
        return cfg
    return load


def first_reply_scored(function):
    """Past the start checks: the env scores its first two replies with ``function``."""
    def score(ctx):
        cfg = generic_task(f"reward.functions=[{{tmp}}/rewards.py:{function}]")(ctx)
        tokenizer = load_tokenizer(cfg.model.name)
        env = make_env(TaskSettings.from_config(cfg), tokenizer, split="train", repeats=1, num_envs=2, shuffle=False)
        td = env.reset()
        reply = History(role=["assistant"] * 2, content=["2"] * 2, batch_size=(2,)).unsqueeze(-1)
        td["history", "full"] = td["history", "prompt"].extend(reply, inplace=False, dim=-1)
        env.step(td)
    return score


def export_from(target, out="out"):
    """``python -m grpo.export <target> <out>`` as its main() runs it, among: run/ (a checkpoint, an old pickle),
    damaged/ (a checkpoint with a flipped byte), used/ (a folder holding a file); paths under the case's tmp."""
    def export(ctx):
        copy_checkpoint_files(ctx.made_run, ctx.tmp / "run" / "checkpoints")
        (ctx.tmp / "used").mkdir()
        (ctx.tmp / "used" / "config.json").write_text("{}")
        (ctx.tmp / "run" / "old.pt").write_bytes(b"pickle")
        damaged = ctx.tmp / "damaged" / "checkpoints"
        copy_checkpoint_files(ctx.made_run, damaged)
        tensors = next(damaged.glob("*.safetensors"))
        data = bytearray(tensors.read_bytes())
        data[-1] ^= 1
        tensors.write_bytes(bytes(data))
        export_checkpoint(ctx.tmp / target, ctx.tmp / out)
    return export


def case(id, action, expected, *words, absent=()):
    return pytest.param(action, expected, words, absent, id=id)


CASES = [
    # config values: validate_config, the first thing start_run does
    case("lr-negative", config("optimizer.lr=-1e-4"), ConfigError, "optimizer.lr=-0.0001", "must be > 0", "default"),
    case("lr-zero", config("optimizer.lr=0"), ConfigError, "optimizer.lr=0", "must be > 0", "nothing trains"),
    case("temperature-zero", config("inference_model.temperature=0"), ConfigError,
         "inference_model.temperature=0", "must be > 0", "default is 1.0"),
    case("temperature-negative", config("inference_model.temperature=-0.5"), ConfigError,
         "inference_model.temperature=-0.5", "must be > 0"),
    case("top_p-zero", config("inference_model.top_p=0"), ConfigError, "inference_model.top_p=0", "(0, 1]"),
    case("seed-negative", config("seed=-1"), ConfigError, "seed=-1", ">= 0", "seed=0"),
    case("ref-micro_batch_tokens-zero", config("ref_model.micro_batch_tokens=0"), ConfigError,
         "ref_model.micro_batch_tokens=0", ">= 1", "null"),
    case("num_envs-zero", config("env.num_envs=0"), ConfigError, "env.num_envs=0", ">= 1"),
    case("dialog_turns_per_batch-zero", config("train.dialog_turns_per_batch=0"), ConfigError,
         "train.dialog_turns_per_batch=0", ">= 1"),
    case("eval.batch_size-zero", config("eval.batch_size=0"), ConfigError, "eval.batch_size=0", ">= 1"),
    case("loss_variant-unknown", config("train.loss_variant=ppo"), ConfigError, "train.loss_variant='ppo'",
         "grpo, dr_grpo or gspo"),
    case("kl_to_ref_coeff-negative", config("train.kl_to_ref_coeff=-0.1"), ConfigError,
         "train.kl_to_ref_coeff=-0.1", ">= 0", "0 turns the term off"),
    case("schedule-linear", config("optimizer.schedule=linear"), ConfigError,
         "optimizer.schedule='linear'", "constant or cosine"),
    case("samples_every-negative", config("logging.samples_every=-1"), ConfigError, "logging.samples_every=-1",
         ">= 0", "0 = never"),
    case("samples_count-zero", config("logging.samples_count=0"), ConfigError, "logging.samples_count=0", ">= 1"),
    case("vllm-not-installed", vllm_not_installed, ConfigError, "vllm", "pip install",
         "inference_model.backend=transformers"),
    # data rows: each task's load_rows, as start_run calls it
    case("malformed-json", gsm8k_train(jsonl(GOOD[:2]) + "{not json\n"), DataError,
         "env.dataset=", "train.jsonl", "JSON", "row 2"),
    case("row-without-answer", gsm8k_train(GOOD[:2] + [{"question": "What is 2 + 2?"}]), DataError,
         "split 'train' row 2", "answer", "'#### N'", "got None"),
    case("empty-file", gsm8k_train(""), DataError, "env.dataset=", "train.jsonl", "empty"),
    case("null-question", gsm8k_train(GOOD[:2] + [{"question": None, "answer": "#### 4"}]), DataError,
         "split 'train' row 2", "question must be non-empty text", "got None"),
    case("empty-question", gsm8k_train(GOOD[:2] + [{"question": "  ", "answer": "#### 4"}]), DataError,
         "split 'train' row 2", "question must be non-empty text"),
    case("not-utf8", gsm8k_train(jsonl(GOOD[:2]).encode() + jsonl(GOOD[2:3]).encode().replace(b"What", b"Wh\xe9t")),
         DataError, "env.dataset=", "split 'train' row 2, column 'question'", "UTF8", "save the file as UTF-8"),
    case("answer-four-in-words", gsm8k_train(GOOD + [{"question": "What is 2 + 2?", "answer": "2 + 2\n#### four"}]),
         UserWarning, "split 'train'", "not a number", "row 16", "always score 0"),
    case("one-row-dataset", gsm8k_train(GOOD[:1]), UserWarning, "split 'train' has 1 row(s)",
         "fewer than the 8 prompts a step draws", "train.dialog_turns_per_batch / env.repeats"),
    case("question-100k-characters", long_question, DataError, "split 'train' row 1", "tokens",
         "inference_model.max_new_tokens=24", "inference_model.max_model_len=512", "shorten or drop the row"),
    case("ifeval-unknown-instruction", ifeval_train({"instruction_id_list": ["nope:nope"], "kwargs": [{}]}),
         DataError, "split 'train' row 1 (key=2)", "'nope:nope'", "unsupported instruction id", "supported:"),
    case("ifeval-bad-kwargs", ifeval_train({"instruction_id_list": ["length_constraints:number_words"],
                                            "kwargs": [{"num_words": "many", "relation": "less than"}]}),
         DataError, "split 'train' row 1 (key=2)", "'num_words'", "expected an int"),
    # model folders: load_tokenizer, the first model file a run reads
    case("model-without-weights", model_folder_without("*.safetensors"), ModelLoadError,
         "model.name=", "lacks weights", "save_pretrained", absent=("Offline",)),
    case("model-without-config", model_folder_without("config.json"), ModelLoadError,
         "model.name=", "lacks config.json", "save_pretrained", absent=("Offline",)),
    case("model-without-tokenizer", model_folder_without("tokenizer*"), ModelLoadError,
         "model.name=", "lacks a tokenizer", "save_pretrained", absent=("Offline",)),
    # run dirs and resume: start_run, before any model loads
    case("resume-another-model", resume_with_another_model, ResumeError,
         "resume", "model.name=", "smollm2-135m-instruct", "as it was, or start without resume"),
    case("resume-foreign-payload", resume_a_foreign_payload, ResumeError,
         "resume", "is not a checkpoint of this project"),
    case("used-run-dir-without-resume", used_run_dir, ConfigError, "already holds a run", "resume=", "hydra.run.dir"),
    case("resume-empty-folder", resume_an_empty_folder, ResumeError, "resume=", "no readable", "give a run dir"),
    case("resume-flat-folder", resume_a_flat_folder, ResumeError, "resume", "is not in a run dir",
         "give the run dir it came from"),
    # your own task (env.task=generic) and reward functions: the config, the splits, the functions' first call
    case("generic-without-reward-functions", config("env.task=generic"), ConfigError, "env.task=generic",
         "reward.functions is empty", "reward.functions=[my_pkg.rewards:score]"),
    case("reward-function-without-colon", config("reward.functions=[my_rewards]"), ConfigError,
         "reward.functions[0]='my_rewards'", "module.path:function or path/to/file.py:function"),
    case("reward-weights-mismatch", config("reward.functions=[a:b,c:d]", "reward.weights=[1.0]"), ConfigError,
         "reward.weights has 1 entries for 2 reward.functions", "one weight per function"),
    case("generic-prompt-column-missing", generic_task("env.prompt_key=prompt", "reward.functions=[a:b]"), DataError,
         "env.prompt_key='prompt'", "has no column 'prompt'", "its columns are ['question', 'answer']"),
    case("generic-answer-column-missing", generic_task("env.answer_key=gold", "reward.functions=[a:b]"), DataError,
         "env.answer_key='gold'", "has no column 'gold'", "its columns are ['question', 'answer']"),
    case("reward-module-missing", generic_task("reward.functions=[no_such_module.rewards:score]"), ConfigError,
         "reward.functions[0]='no_such_module.rewards:score'", "no module 'no_such_module'", "PYTHONPATH"),
    case("reward-file-missing", generic_task("reward.functions=[{tmp}/nope.py:score]"), ConfigError,
         "reward.functions[0]=", "no file", "nope.py", "give the path of a .py file"),
    case("reward-function-missing", generic_task("reward.functions=[{tmp}/rewards.py:scor]"), ConfigError,
         "reward.functions[0]=", "defines no 'scor'", "score", "fix the name after the colon"),
    case("reward-function-unknown-parameter", generic_task("reward.functions=[{tmp}/rewards.py:needs_gold]"),
         ConfigError, "needs_gold(reply, gold)", "needs ['gold']", "prompt, reply, episode, question, answer",
         "give it a default, or take **row"),
    case("reward-function-never-sees-reply", generic_task("reward.functions=[{tmp}/rewards.py:no_reply]"),
         ConfigError, "no_reply(prompt)", "never sees the reply", "def no_reply(prompt, reply, **row)"),
    case("reward-function-returns-nan", first_reply_scored("nan"), ConfigError, "rewards.py:nan", "returned nan",
         "row 0", "return a finite number"),
    case("reward-function-returns-text", first_reply_scored("text"), ConfigError, "rewards.py:text",
         "returned 'good' (str)", "must return a number"),
    case("reward-function-batched-wrong-length", first_reply_scored("batch"), ConfigError, "rewards.py:batch",
         "is batched and returned 1 values for a batch of 2 replies", "one number per reply"),
    # exports: python -m grpo.export <checkpoint> <out>
    case("export-missing-checkpoint", export_from("run/checkpoints/step_00000009.json"), ExportError,
         "step_00000009.json does not exist", "give a run dir or one of its checkpoints/step_*.json"),
    case("export-a-pickle", export_from("run/old.pt"), ExportError, "old.pt is not a checkpoint", "never loaded"),
    case("export-damaged-checkpoint", export_from("damaged/checkpoints/step_00000000.json"), ExportError,
         "is unreadable", "does not match its sha256", "export another checkpoint"),
    case("export-run-without-checkpoints", export_from("used"), ExportError, "holds no readable step_*.json",
         "give a run dir"),
    case("export-into-a-used-folder", export_from("run", out="used"), ExportError, "used is not an empty folder",
         "give a new or empty folder"),
    case("total_steps-negative", config("train.total_steps=-1"), ConfigError, "train.total_steps=-1", ">= 0",
         "0 = evaluate only"),
    case("export-not-a-bool", config("logging.export=maybe"), ConfigError, "logging.export='maybe'", "true or false"),
    case("max_minutes-zero", config("train.max_minutes=0"), ConfigError, "train.max_minutes=0", "> 0", "or null"),
    case("max_minutes-text", config("train.max_minutes=soon"), ConfigError, "train.max_minutes='soon'", "> 0"),
]


@pytest.mark.parametrize("action, expected, words, absent", CASES)
def test_bad_input_stops_with_one_clear_line(action, expected, words, absent, tmp_path, monkeypatch, request):
    ctx = Context(tmp_path, monkeypatch, request)
    if issubclass(expected, Warning):
        with pytest.warns(expected) as caught:
            action(ctx)
        message = " ".join(str(w.message) for w in caught if issubclass(w.category, expected))
    else:
        with pytest.raises(expected) as info:
            action(ctx)
        assert isinstance(info.value, UserError), type(info.value).__mro__  # so clear_errors prints it as one line
        message = str(info.value)
        assert "\n" not in message, message
    missing = [w for w in words if w not in message]
    assert not missing and not [w for w in absent if w in message], (missing, message)


# ------------------------------------------------------------------------------------ through the script

def script_null_question(tmp_path):
    folder = gsm8k_folder(tmp_path, GOOD[:3] + [{"question": None, "answer": "#### 1"}])
    return [f"env.dataset={folder}", f"hydra.run.dir={tmp_path / 'run'}"]


def script_long_question(tmp_path):
    return [f"env.dataset={gsm8k_folder(tmp_path, LONG)}", f"hydra.run.dir={tmp_path / 'run'}"]


def script_used_run_dir(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "event": "start"}\n')
    return [f"hydra.run.dir={tmp_path}"]


@pytest.mark.parametrize("overrides, words", [
    # crashed when the row was drawn, after 20 trained steps, nothing saved
    pytest.param(script_null_question, ["row 3", "question must be non-empty text"], id="null-question"),
    # no step within 300 s
    pytest.param(script_long_question, ["row 1", "inference_model.max_model_len=512", "shorten or drop"],
                 id="question-100k-characters"),
    # appended to the old run's metrics and pruned the new run's checkpoints
    pytest.param(script_used_run_dir, ["already holds a run", "resume={tmp}"], id="used-run-dir-without-resume"),
])
def test_the_script_prints_one_line_and_no_traceback(overrides, words, tmp_path):
    """The user's view: exit status 2 and one line on stderr, no traceback, nothing written."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}  # datasets draws a bar on stderr when it first reads a file
    proc = subprocess.run([sys.executable, str(REPO / "grpo" / "grpo.py"), "--config-name", "grpo_tiny",
                           *overrides(tmp_path)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    assert all(w.format(tmp=tmp_path) in lines[0] for w in words), lines[0]
    if (tmp_path / "metrics.jsonl").exists():
        assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 0, "event": "start"}\n'


@pytest.mark.parametrize("config_name, model, row", [
    ("grpo_tiny", "tiny_model_dir", GOOD[0]),
    # TorchRL picks its own ChatML template for SmolLM2, not the tokenizer's
    ("grpo_smollm", "real_model_dir", GOOD[0]),
    ("grpo_ifeval_tiny", "tiny_model_dir", {"key": 1, "prompt": "Write a haiku about rain.", "instruction_id_list":
                                            ["punctuation:no_comma"], "kwargs": [{}]}),
])
def test_the_length_check_counts_prompts_as_the_policy_sees_them(config_name, model, row, tmp_path, request):
    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_text(jsonl([row]))
    overrides = [f"model.name={request.getfixturevalue(model)}", f"env.dataset={tmp_path}"]
    cfg = compose(config_name, overrides)
    tokenizer = load_tokenizer(cfg.model.name)
    settings = TaskSettings.from_config(cfg)
    env = make_env(settings, tokenizer, split=settings.train_split, repeats=1, num_envs=1)
    policy_model = load_policy_model(ModelSettings.from_config(cfg), tokenizer, torch.device("cpu"))
    sampler = ReplySampler(policy_model, compile=False, cache_bucket=64, compact_rows=True)
    policy = make_transformers_policy(sampler, tokenizer, gen_kwargs={
        "max_new_tokens": 1, "do_sample": False, "eos_token_id": [tokenizer.eos_token_id],
        "pad_token_id": tokenizer.pad_token_id})
    prompt_tokens = len(policy(env.reset()).get(("tokens", "prompt"), as_list=True)[0])

    def with_context(max_model_len):
        return TaskSettings.from_config(compose(config_name,
                                                [*overrides, f"inference_model.max_model_len={max_model_len}"]))

    reply = max(cfg.inference_model.max_new_tokens, cfg.eval.max_new_tokens)
    splits = {split: task_of(settings).load_rows(settings, split) for split in ("train", "test")}
    check_prompt_lengths(with_context(prompt_tokens + reply), tokenizer, splits)  # exactly full: fits
    with pytest.raises(DataError, match=f"row 0: its prompt is {prompt_tokens} tokens"):
        check_prompt_lengths(with_context(prompt_tokens + reply - 1), tokenizer, splits)


def test_clear_errors_prints_a_user_error_as_one_line(capsys):
    with pytest.raises(SystemExit) as info, clear_errors():
        raise ModelLoadError("model.name='x': cannot load its tokenizer (We couldn't connect\nto the hub.)")
    assert info.value.code == 2
    assert capsys.readouterr().err == ("error: model.name='x': cannot load its tokenizer (We couldn't connect to "
                                       "the hub.)\n")
    with pytest.raises(KeyError), clear_errors():  # a bug is no user error: it keeps its traceback
        raise KeyError("step")
