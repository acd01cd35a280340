"""The sandbox of model-written code (grpo/tasks/sandbox.py): each test tries an escape and checks on the host that
it did not happen. Protections are skipped only where this machine's kernel refuses them (checked here, apart from
the sandbox's own probe)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from grpo.tasks.sandbox import Sandbox, SandboxError, SandboxSettings

REPO = Path(__file__).resolve().parents[1]
ROOT = os.geteuid() == 0
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000


def kernel_allows(flags: int) -> bool:
    """Whether this process may unshare these namespaces (not root: inside a user namespace of its own)."""
    flags |= 0 if ROOT else CLONE_NEWUSER
    check = f"import ctypes, os; os._exit(0 if ctypes.CDLL(None).unshare({flags}) == 0 else 1)"
    return subprocess.run([sys.executable, "-I", "-c", check], check=False).returncode == 0


MOUNTS, NETWORK, PIDS = kernel_allows(CLONE_NEWNS), kernel_allows(CLONE_NEWNET), kernel_allows(CLONE_NEWPID)


def code(text: str) -> str:
    return textwrap.dedent(text).strip() + "\n"


def processes_of(uids) -> list[str]:
    """The host's processes running as one of these uids: what a call left behind."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        uid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
        if uid in uids:
            found.append(f"{pid} uid {uid}: {cmdline}")
    return found


def processes_running(marker: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            pass
    return found


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(SandboxSettings(timeout_s=10.0, workers=4)) as box:
        yield box


@pytest.fixture(scope="module")
def fast():
    """A short timeout: for the code that never ends."""
    with Sandbox(SandboxSettings(timeout_s=2.5, workers=4)) as box:
        yield box


def test_describe_says_what_is_on(sandbox):
    line = sandbox.describe()
    assert line.startswith("sandbox: ") and "\n" not in line
    assert sandbox.python in line and "cleared env" in line
    on = sandbox.protections
    assert on["isolated_interpreter"] and on["cleared_environment"] and on["rlimits"]
    # the probe kept every protection this kernel allows (none dropped by a bug of the sandbox's)
    assert (on["private_filesystem"], on["no_network"], on["pid_namespace"]) == (MOUNTS, NETWORK, PIDS)
    if ROOT:
        assert on["own_uid"] and "(not root)" in line and all(uid >= 60001 for uid in sandbox.uids)
        assert len(set(sandbox.uids)) == 4  # one a worker
    else:
        assert "not root" in line


def test_output_then_traceback(sandbox):
    run = sandbox.run(code("""
        print("hello")
        raise ValueError("boom")
    """))
    assert run.failed is None and not run.timed_out and run.exit_code == 1
    assert run.output.startswith("hello\nTraceback (most recent call last):")
    assert run.output.rstrip().endswith("ValueError: boom")


def test_any_output_exit_or_signal_is_an_answer(sandbox):
    run = sandbox.run(code("""
        import os, signal, sys
        sys.stdout.buffer.write(b"\\xff\\xfe not utf-8\\n")
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGSEGV)
    """))
    assert run.failed is None and run.exit_code == -signal.SIGSEGV
    assert run.output == "\ufffd\ufffd not utf-8\n[killed by SIGSEGV]"
    run = sandbox.run("import sys; sys.exit(3)")
    assert (run.output, run.exit_code, run.failed) == ("[exit status 3]", 3, None)
    run = sandbox.run("x = input()")  # stdin is empty
    assert "EOFError" in run.output and run.failed is None


def test_fresh_interpreter_in_an_empty_directory(sandbox):
    check = code("""
        import os, sys
        print(sys.flags.isolated, os.listdir("."), sorted(os.listdir(f"/proc/{os.getpid()}/fd")))
        open("left-behind", "w").write("x")
    """)
    first, second = sandbox.run(check), sandbox.run(check)
    assert first.output == second.output == "1 [] ['0', '1', '2', '3']\n"  # 3: the listing's own; nothing kept


def test_code_cannot_forge_the_sandbox_status(sandbox):
    run = sandbox.run(code("""
        import os
        for fd in range(3, 256):
            try:
                os.write(fd, b"error launcher forged\\nexit 0\\n")
            except OSError:
                pass
        raise SystemExit(5)
    """))
    assert run.failed is None and run.exit_code == 5


def test_caller_environment_is_not_readable(sandbox, monkeypatch):
    secret = "wandb-" + uuid.uuid4().hex
    monkeypatch.setenv("WANDB_API_KEY", secret)
    run = sandbox.run(code(f"""
        import os
        print(dict(os.environ))
        for pid in ({os.getpid()}, os.getppid(), 1):
            try:
                print(pid, open(f"/proc/{{pid}}/environ", "rb").read())
            except OSError as err:
                print(pid, err)
    """))
    assert run.failed is None and "PATH" in run.output
    assert secret not in run.output and "WANDB" not in run.output


@pytest.mark.skipif(not ROOT, reason="a uid of its own needs root")
def test_writes_outside_its_directory_refused_by_its_uid(sandbox):
    target = REPO / f"escaped-{uuid.uuid4().hex}"  # root's directory, not world-writable
    try:
        run = sandbox.run(f"open({str(target)!r}, 'w').write('x')")
        # refused, or not even there: a repo under /tmp lies under the sandbox's own private /tmp
        refused = ("Read-only file system", "Permission denied", "No such file or directory")
        assert run.failed is None and any(reason in run.output for reason in refused)
        assert not target.exists()
    finally:
        target.unlink(missing_ok=True)


@pytest.mark.skipif(not MOUNTS, reason="the kernel refuses a mount namespace here")
def test_writes_to_world_writable_host_dirs_do_not_reach_the_host(sandbox, tmp_path):
    tmp_path.chmod(0o777)
    name = f"escaped-{uuid.uuid4().hex}"
    victim = tmp_path / "victim.txt"
    victim.write_text("intact")
    victim.chmod(0o666)
    targets = [tmp_path / name, Path("/tmp") / name, Path("/var/tmp") / name, Path("/dev/shm") / name]
    try:
        run = sandbox.run(code(f"""
            for path in {[str(t) for t in targets] + [str(victim)]!r}:
                try:
                    open(path, "w").write("escaped")
                    print("wrote", path)
                except OSError as err:
                    print(path, err)
            open("mine.txt", "w").write("ok")  # its own directory works
            open("/dev/null", "w").write("x")
            print(open("mine.txt").read())
        """))
        assert run.failed is None and run.output.rstrip().endswith("ok"), run.output
        assert not any(target.exists() for target in targets)
        assert victim.read_text() == "intact"
    finally:
        for target in targets:
            target.unlink(missing_ok=True)


@pytest.mark.skipif(not NETWORK, reason="the kernel refuses a network namespace here")
def test_no_network(sandbox):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        run = sandbox.run(code(f"""
            import socket
            for host in ("127.0.0.1", "localhost", "example.com"):
                try:
                    socket.create_connection((host, {port}), timeout=2)
                    print("connected", host)
                except OSError as err:
                    print("refused", host, err)
        """))
        assert run.failed is None and "connected" not in run.output and run.output.count("refused") == 3
        with pytest.raises(BlockingIOError):
            server.accept()  # no one knocked


def test_endless_loop_times_out(fast):
    run = fast.run(code("""
        print("started")
        while True:
            pass
    """))
    assert run.timed_out and run.failed is None and run.exit_code is None
    assert run.output == "started\n[timed out after 2.5 s]"
    assert run.seconds < 2.5 + 3  # the launcher's grace past the timeout
    assert not processes_of(fast.uids)


def test_cpu_time_and_file_size_limits():
    with Sandbox(SandboxSettings(timeout_s=20.0, cpu_s=1, file_size_mb=1, workers=1)) as box:
        run = box.run("open('big', 'wb').write(b'x' * (2 << 20))")
        assert "File too large" in run.output and run.exit_code == 1
        run = box.run("while True: pass")
        assert not run.timed_out and run.exit_code == -signal.SIGXCPU
        assert "[killed by SIGXCPU: CPU time limit of 1 s]" in run.output


def test_memory_limit(sandbox):
    run = sandbox.run("x = bytearray(6 * 1024 ** 3)\nprint('allocated')")
    assert run.failed is None and "MemoryError" in run.output and "allocated" not in run.output


def test_fork_bomb_is_limited(sandbox, fast):
    run = sandbox.run(code("""
        import os, time
        forked = 0
        try:
            for _ in range(5000):
                if os.fork() == 0:
                    time.sleep(60)
                    os._exit(0)
                forked += 1
        except OSError as err:
            print("refused after", forked, err.strerror)
    """))
    words = run.output.split()
    assert run.failed is None and words[:2] == ["refused", "after"], run.output
    if ROOT:  # a uid of its own: RLIMIT_NPROC counts only this call's processes
        assert int(words[2]) < sandbox.settings.processes
    assert not run.timed_out and not processes_of(sandbox.uids)  # its sleeping children went with it
    run = fast.run(code("""
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """))
    assert run.timed_out and run.failed is None
    assert not processes_of(fast.uids)


@pytest.mark.skipif(not (ROOT or PIDS), reason="without root or a pid namespace, setsid() escapes the call")
def test_no_process_left_behind(sandbox):
    marker = f"{time.time() % 1000:.6f}"  # a sleep no one else runs
    run = sandbox.run(code(f"""
        import os, subprocess
        subprocess.Popen(["sleep", "1000.{marker.replace('.', '')}"], start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if os.fork() == 0:  # a daemon: own session, no output pipe held
            os.setsid()
            os.close(1)
            os.close(2)
            os.execvp("sleep", ["sleep", "1000.{marker.replace('.', '')}"])
        print("spawned")
    """))
    assert run.output == "spawned\n" and not run.timed_out
    assert not processes_running("1000." + marker.replace(".", ""))
    assert not processes_of(sandbox.uids)


def test_huge_print_is_cut_and_read_bounded(sandbox):
    run = sandbox.run(code("""
        import sys
        print("x" * 100_000_000)
        print("done", file=sys.stderr)
    """))
    cap = sandbox.settings.output_chars
    assert run.failed is None and not run.timed_out and run.exit_code == 0
    assert run.output.endswith("done\n[output cut at 4096 characters]")
    assert len(run.output) <= cap + 40 and run.output.startswith("x" * 1000)


@pytest.mark.skipif(not (ROOT or PIDS), reason="without root or a pid namespace, the code runs as its caller's uid")
def test_code_cannot_kill_its_caller(sandbox):
    run = sandbox.run(code(f"""
        import os, signal
        for pid in ({os.getpid()}, os.getppid(), 1, -1):
            try:
                os.kill(pid, signal.SIGKILL)
                print("killed", pid)
            except OSError as err:
                print("refused", pid, err.strerror)
    """))
    assert run.failed is None and run.output.count("refused") >= 3, run.output
    assert sandbox.run("print('still here')").output == "still here\n"  # this process and the sandbox both live


def test_run_many_a_slow_call_holds_no_other(fast):
    codes = ["import time; time.sleep(60)"] + [f"print({i} * 7)" for i in range(1, 7)]
    runs = fast.run_many(codes)
    assert runs[0].timed_out and runs[0].output == "[timed out after 2.5 s]"
    assert [run.output for run in runs[1:]] == [f"{i * 7}\n" for i in range(1, 7)]
    assert not any(run.timed_out or run.failed for run in runs[1:])
    assert all(run.seconds < 2.5 for run in runs[1:])  # not one waited for the slow call's timeout


def test_run_many_runs_calls_at_once(sandbox):
    runs = sandbox.run_many(["import time\nstart = time.time()\ntime.sleep(1.5)\nprint(start, time.time())"] * 4)
    spans = [tuple(map(float, run.output.split())) for run in runs]
    assert max(start for start, _ in spans) < min(end for _, end in spans)  # all four were running together
    assert sandbox.run_many([]) == []


def test_an_interpreter_it_cannot_run_is_the_sandbox_failure(sandbox, monkeypatch):
    with pytest.raises(SandboxError, match="no interpreter the sandbox can run"):
        Sandbox(SandboxSettings(python="/nonexistent/python3", workers=1))
    monkeypatch.setattr(sandbox, "python", "/nonexistent/python3")  # gone after start-up
    run = sandbox.run("print('hi')")
    assert run.failed.startswith("cannot run /nonexistent/python3") and run.exit_code is None and not run.timed_out


@pytest.mark.skipif(not ROOT, reason="a uid of its own needs root")
def test_root_without_namespaces_still_contains_the_code():
    """A container that refuses namespaces (Docker's default seccomp): the call's own uid, the reaper that kills
    every process of it, rlimits and the cleared environment still hold."""
    box = Sandbox(SandboxSettings(timeout_s=2.5, workers=2))
    box._features = frozenset({"setuid"})  # as the probe finds it there
    marker = f"2000.{uuid.uuid4().int % 10**9}"
    target = REPO / f"escaped-{uuid.uuid4().hex}"
    try:
        run = box.run(code(f"""
            import os, signal, subprocess
            subprocess.Popen(["sleep", "{marker}"], start_new_session=True)  # holds the output pipes too
            for pid in ({os.getpid()}, os.getppid()):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError as err:
                    print("refused", err.strerror)
            try:
                open({str(target)!r}, "w")
            except OSError as err:
                print("refused", err.strerror)
            print(os.getuid(), os.environ.get("WANDB_API_KEY"))
        """))
        lines = run.output.splitlines()
        assert lines[:2] == ["refused Operation not permitted"] * 2 and lines[2] == "refused Permission denied"
        assert int(lines[3].split()[0]) in box.uids and lines[3].endswith(" None") and len(lines) == 4
        assert not run.timed_out and run.seconds < 2.5  # not held by the sleep's copy of its pipes
        assert not target.exists() and not processes_running(marker) and not processes_of(box.uids)
        run = box.run("import time\nwhile True: time.sleep(1)")
        assert run.timed_out and not processes_of(box.uids)
    finally:
        box.close()
        target.unlink(missing_ok=True)


@pytest.mark.skipif(not ROOT or not os.path.realpath(sys.executable).startswith("/root/"),
                    reason="this Python is not one under root's home")
def test_root_home_interpreter_is_refused_with_its_reason():
    with pytest.raises(SandboxError, match="Permission denied"):
        Sandbox(SandboxSettings(python=os.path.realpath(sys.executable), workers=1))


def test_command_line(tmp_path):
    script = tmp_path / "call.py"
    script.write_text("print('partial')\nraise RuntimeError('from the model')\n")
    done = subprocess.run([sys.executable, "-m", "grpo.tasks.sandbox", str(script), "--timeout-s", "20"],
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("partial\nTraceback") and "RuntimeError: from the model" in done.stdout
    broken = subprocess.run([sys.executable, str(REPO / "grpo/tasks/sandbox.py"), str(script), "--python",
                             "/nonexistent/python3"], capture_output=True, text=True, timeout=60, check=False)
    assert broken.returncode == 1 and broken.stdout == ""
    assert broken.stderr.startswith("grpo-sandbox: no interpreter") and broken.stderr.count("\n") == 1


@pytest.mark.skipif(not ROOT or not os.access("/usr/bin/python3", os.X_OK), reason="needs root to become nobody")
def test_not_root_runs_with_what_it_can():
    """A user's laptop: no uid to switch to; the user namespace's protections where the kernel allows them."""
    home = Path(tempfile.mkdtemp())
    try:
        home.chmod(0o755)
        shutil.copy(REPO / "grpo/tasks/sandbox.py", home / "sandbox.py")
        (home / "call.py").write_text("import os\nprint('uid', os.getuid(), sorted(os.environ))\n")
        for path in home.iterdir():
            path.chmod(0o644)
        secret = "token-" + uuid.uuid4().hex
        done = subprocess.run(["/usr/bin/python3", "-I", "sandbox.py", "--describe", "call.py"], cwd=home,
                              user=65534, group=65534, extra_groups=[], env={"SECRET_TOKEN": secret},
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("uid 65534 ['HOME', 'LANG'") and secret not in done.stdout
        assert "off: own uid (not root" in done.stderr
    finally:
        shutil.rmtree(home)
