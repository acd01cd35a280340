"""Runs untrusted, model-written Python: one tool call, one throw-away sandbox.

A model trained with RL writes Python in its tool calls; ``Sandbox.run`` runs one call's code and returns what the
tool answers the model (stdout then stderr, cut to a size). The code is taken to be hostile. What it cannot do, and
what stops it:

- read the trainer's secrets or state: a fresh interpreter per call in isolated mode (``-I``: no PYTHON* variable,
  no user site-packages, no script directory on sys.path), a fixed environment (PATH, HOME, TMPDIR, LANG, thread
  counts: nothing of the caller's), its own empty working directory;
- write outside that directory: as root, a private mount namespace in which every host mount is read-only and /tmp
  and /dev/shm are small private tmpfs that vanish with the call; and the code runs as a uid that owns nothing;
- reach the network: its own network namespace, in which no interface is up (not even loopback);
- exhaust the host: rlimits on CPU time, address space, file size, open files and processes; RLIMIT_NPROC counts a
  call's own processes only, each running call having its own uid;
- outlive the call or dodge its timeout: a PID namespace (the kernel kills all of it when its init ends); at the
  wall-clock timeout its whole process group and namespace are killed; after every call each process of the call's
  uid is killed (setsid() leaves a process group, never a uid);
- harm its caller: it runs as uid 60001 and up (one per running call, no passwd entry, no groups, no_new_privs so no
  set-user-ID program gives root back), which may signal no process of root; from its PID namespace it sees none.

How: no ``preexec_fn`` (forking a threaded trainer to run Python code there can deadlock). A thread starts a small
launcher, ``_LAUNCHER``, run by the trainer's own Python with ``-I -S``: it unshares the namespaces, mounts, sets the
rlimits, drops to the call's uid and execs the sandbox interpreter on the code. The sandbox interpreter is a system
Python the dropped uid may execute (a pyenv Python under /root is not one), found and checked at construction.

Not root (a laptop): no uid to switch to. Where the kernel allows unprivileged user namespaces, the namespaces above
still apply (the code runs as the calling user inside them); else the code runs with rlimits, a cleared environment
and its own directory only. ``describe()`` says which protections are on, ``protections`` holds them.

Not done: the code can read world-readable host files (/etc, a data set under /work...); nothing filters system calls
(no seccomp: not in the standard library), so the kernel's whole interface, user namespaces included where the host
allows them, is open to the code.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import fcntl
import os
import pwd
import queue
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

FIRST_UID, LAST_UID = 60001, 61183  # the calls' uids: below systemd's dynamic users (61184+) and nobody (65534)
_GRACE_S = 3.0  # past the timeout, how long the launcher may take to kill and report before it is killed itself
_PROBE_TIMEOUT_S = 30.0
_WHAT = {"userns": "user namespace", "mounts": "private filesystem", "net": "network namespace", "ipc": "ipc namespace",
         "pid": "pid namespace", "proc": "own /proc", "setuid": "own uid", "limits": "rlimits",
         "exec": "interpreter", "launcher": "launcher"}
_OFF_MEANS = {"mounts": "world-writable host dirs such as /tmp are writable", "net": "the network is reachable",
              "pid": "host processes visible"}


@dataclasses.dataclass(frozen=True)
class SandboxSettings:
    timeout_s: float = 5.0  # wall clock per call; the call's process group and namespace killed at it
    cpu_s: int = 5  # RLIMIT_CPU: SIGXCPU at it
    memory_mb: int = 512  # RLIMIT_AS: MemoryError past it
    file_size_mb: int = 16  # RLIMIT_FSIZE; the private /tmp holds 4x this
    processes: int = 16  # RLIMIT_NPROC, threads included
    output_chars: int = 4096  # stdout+stderr cut to this; never more than ~4 bytes a character held in memory
    workers: int = 8  # calls run at once
    python: str | None = None  # the sandbox's interpreter; None: the first of /usr/bin/python3... that works

    def __post_init__(self):
        for name in ("timeout_s", "cpu_s", "memory_mb", "file_size_mb", "processes", "output_chars", "workers"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxSettings.{name}={getattr(self, name)!r}: must be positive")


@dataclasses.dataclass
class ToolRun:
    output: str  # what the tool answers: stdout then stderr, cut, with markers ("[timed out after 5.0 s]")
    timed_out: bool
    failed: str | None  # why the sandbox itself could not run the code (not the model's fault); None when it ran
    seconds: float
    exit_code: int | None = None  # the code's exit status, -N when killed by signal N; None: timed out or failed


class SandboxError(RuntimeError):
    """The sandbox cannot run code on this machine at all (no interpreter the dropped uid may execute...)."""


# Runs as the caller (root) in a fresh `python -I -S`; reads the code on stdin, reports on fd `status` one line each:
# "error STAGE MESSAGE" (the sandbox failed), "exit N" / "signal N" (how the code ended), "timeout".
_LAUNCHER = r'''
import ctypes, os, resource, select, signal, sys, time

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x20000, 0x8000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
MS_PRIVATE = 1 << 18
KEPT_FLAGS = {b"nodev": MS_NODEV, b"noexec": MS_NOEXEC, b"noatime": 1024, b"nodiratime": 2048, b"relatime": 1 << 21}
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
MB = 1 << 20

status, uid, deadline, features, python, hostdir, cpu_s, memory_mb, file_size_mb, processes = sys.argv[1:]
status, uid, deadline, features = int(status), int(uid), float(deadline), set(features.split(",")) - {""}
cpu_s, memory_mb, file_size_mb, processes = int(cpu_s), int(memory_mb), int(file_size_mb), int(processes)
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
stage = "launcher"  # what an error report blames


def report(line):
    os.write(status, line.encode(errors="replace") + b"\n")


def check(result):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def mount(source, target, fstype, flags, data=None):
    check(libc.mount(source, target, fstype, flags, data))


def prctl(option, value):
    check(libc.prctl(option, value, 0, 0, 0))


def fork(body, *args, group=False):
    """A child that runs body and exits; an error is reported, never raised into the launcher's own flow."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            if group:  # a process group of its own, killed whole at the timeout (the launcher sets it too: no race)
                os.setpgid(0, 0)
            body(*args)
        except BaseException as err:
            report(f"error {stage} {err}")
            code = 127
        os._exit(code)
    return pid


def report_end(wait_status):
    if os.WIFSIGNALED(wait_status):
        report(f"signal {os.WTERMSIG(wait_status)}")
    else:
        report(f"exit {os.WEXITSTATUS(wait_status)}")


def tasks_of(user):
    """The threads of the user's processes: what RLIMIT_NPROC counts."""
    count = 0
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/status", "rb") as f:
                fields = dict(line.split(b":", 1) for line in f if b":" in line)
            count += int(fields[b"Threads"]) if int(fields[b"Uid"].split()[0]) == user else 0
        except (OSError, ValueError, KeyError):
            pass
    return count


def start_reaper():
    """A root process out of the call's process group that outlives the launcher, even one killed at the timeout:
    once the launcher (and init) are gone, it kills every process of the call's uid, then exits."""
    trigger_r, trigger_w = os.pipe()
    if os.fork() == 0:
        try:
            os.close(trigger_w)
            os.setsid()
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):  # holds none of the call's output pipes open
                os.dup2(null, fd)
            os.read(trigger_r, 1)  # EOF: every holder of trigger_w has exited
            os.setresuid(uid, uid, uid)
            os.kill(-1, signal.SIGKILL)  # every process this uid may signal: those of the uid, not itself
        except OSError:
            pass
        os._exit(0)
    os.close(trigger_r)
    return trigger_w


def user_namespace():
    user, group = os.getuid(), os.getgid()
    check(libc.unshare(CLONE_NEWUSER))
    for name, text in (("setgroups", "deny"), ("uid_map", f"{user} {user} 1"), ("gid_map", f"{group} {group} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def unescape(field):  # mountinfo writes a space, tab, newline or backslash of a path as \ooo
    parts = field.split(b"\\")
    return parts[0] + b"".join(bytes([int(part[:3], 8)]) + part[3:] for part in parts[1:])


def private_filesystem():
    """Every host mount read-only in a mount namespace of its own; private tmpfs on /tmp and /dev/shm."""
    check(libc.unshare(CLONE_NEWNS))
    mount(None, b"/", None, MS_REC | MS_PRIVATE)  # nothing mounted here propagates to the host
    with open("/proc/self/mountinfo", "rb") as f:
        mounts = [line.split() for line in f.read().splitlines()]
    for fields in mounts:
        target, options = unescape(fields[4]), fields[5].split(b",")
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID  # keeps the mount's other flags (a user namespace must)
        for name, flag in KEPT_FLAGS.items():
            flags |= flag if name in options else 0
        try:
            mount(None, target, None, flags)
        except OSError:
            if not target.startswith((b"/proc", b"/sys")):  # their files are root's (and /proc is mounted anew)
                raise
    for target, size_mb, inodes in ((b"/tmp", 4 * file_size_mb, 16384), (b"/dev/shm", file_size_mb, 1024)):
        if os.path.isdir(target):
            options = f"size={size_mb}m,nr_inodes={inodes},mode=1777".encode()
            mount(b"tmpfs", target, b"tmpfs", MS_NOSUID | MS_NODEV, options)
    return "/tmp"


def place_code(base, code):
    """base/main.py, read-only to the code; base/sandbox, its empty working directory."""
    path, workdir = os.path.join(base, "main.py"), os.path.join(base, "sandbox")
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "wb") as f:
        f.write(code)
    os.mkdir(workdir, 0o700)
    if "setuid" in features:
        os.chown(workdir, uid, uid)
    return path, workdir


def limit(which, soft, hard=None):
    hard = soft if hard is None else hard
    current = resource.getrlimit(which)[1]
    if current != resource.RLIM_INFINITY:  # not root: the hard limit can only come down
        hard = min(hard, current)
    resource.setrlimit(which, (min(soft, hard), hard))


def run_code(code_path, workdir, own_processes):
    global stage
    stage = "limits"
    limit(resource.RLIMIT_CPU, cpu_s, cpu_s + 1)  # SIGXCPU, then SIGKILL a second later
    limit(resource.RLIMIT_AS, memory_mb * MB)
    limit(resource.RLIMIT_FSIZE, file_size_mb * MB)
    limit(resource.RLIMIT_NOFILE, 1024)
    limit(resource.RLIMIT_CORE, 0)
    # RLIMIT_NPROC counts every process of the real uid: the call's own with a uid of its own, else the user's too
    limit(resource.RLIMIT_NPROC, processes + own_processes)
    stage = "setuid"
    if "setuid" in features:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after the uid change, which clears it
    prctl(PR_SET_NO_NEW_PRIVS, 1)  # no set-user-ID program gives root back
    os.chdir(workdir)
    stage = "exec"
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # threads count as processes
    os.execve(python, [python, "-I", "-u", code_path], env)  # -u: what it printed before a timeout is kept


def init(code_path, workdir, own_processes, alive_r, alive_w):
    """PID 1 of the call's PID namespace: runs the code, reaps orphans, ends when the code does; the kernel then kills
    whatever is left in the namespace."""
    global stage
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the launcher killed: this init dies, and with it the namespace
    os.close(alive_w)
    if select.select([alive_r], [], [], 0)[0]:  # EOF: the launcher died before that line
        return
    stage = "proc"
    if "proc" in features:  # shows this namespace's processes only
        mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    stage = "launcher"
    child = fork(run_code, code_path, workdir, own_processes)
    while True:
        pid, wait_status = os.wait()
        if pid == child:
            return report_end(wait_status)


def main():
    global stage
    os.set_inheritable(status, False)  # the code must not write a status line of its own
    os.umask(0o022)
    code = sys.stdin.buffer.read()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the trainer gone, so is this call
    own_processes = 0 if "setuid" in features else tasks_of(os.getuid())
    trigger = None
    if "setuid" in features:
        trigger = start_reaper()
        prctl(PR_SET_CHILD_SUBREAPER, 1)  # the code's orphans come here to be reaped
    if "userns" in features:
        stage = "userns"
        user_namespace()
    base = hostdir
    if "mounts" in features:
        stage = "mounts"
        base = private_filesystem()
    stage = "launcher"
    code_path, workdir = place_code(base, code)
    for name, flag in (("net", CLONE_NEWNET), ("ipc", CLONE_NEWIPC), ("pid", CLONE_NEWPID)):
        if name in features:
            stage = name
            check(libc.unshare(flag))
    stage = "launcher"
    alive_r, alive_w = os.pipe()
    if "pid" in features:
        child = fork(init, code_path, workdir, own_processes, alive_r, alive_w, group=True)
    else:
        child = fork(run_code, code_path, workdir, own_processes, group=True)
    os.close(alive_r)
    try:
        os.setpgid(child, child)
    except OSError:  # it did so itself and has exec'd since
        pass

    def at_deadline(signum, frame):
        report("timeout")
        for kill in (os.killpg, os.kill):
            try:
                kill(child, signal.SIGKILL)
            except OSError:
                pass

    signal.signal(signal.SIGALRM, at_deadline)
    signal.setitimer(signal.ITIMER_REAL, max(deadline - time.monotonic(), 0.001))
    wait_status = os.waitpid(child, 0)[1]
    signal.setitimer(signal.ITIMER_REAL, 0)
    if "pid" not in features:
        report_end(wait_status)
    try:
        os.killpg(child, signal.SIGKILL)  # what is left of its process group
    except OSError:
        pass
    if trigger is not None:
        os.close(trigger)  # the reaper kills every process of the uid...
        while True:  # ...and they are reaped here, the reaper last
            try:
                os.wait()
            except ChildProcessError:
                break


try:
    main()
except BaseException as err:
    report(f"error {stage} {err}")
    sys.exit(1)
'''

_PROBE_CODE = 'import os, sys\nprint(os.getuid(), "%d.%d.%d" % sys.version_info[:3])\n'


class Sandbox:
    """Runs model-written code, one fresh sandbox a call; ``run`` and ``run_many`` may be called from any thread."""

    def __init__(self, settings: SandboxSettings = SandboxSettings()):
        self.settings = settings
        self.root = os.geteuid() == 0
        self._launcher = sys.executable or shutil.which("python3") or "/usr/bin/python3"
        self._locks: list[int] = []
        self.uids = self._claim_uids(settings.workers) if self.root else []
        self._slots: queue.SimpleQueue[int] = queue.SimpleQueue()
        for uid in self.uids or [-1] * settings.workers:
            self._slots.put(uid)
        try:
            self.python, self.python_version, self._features, self._off = self._choose()
        except BaseException:
            self.close()
            raise
        on = self._features
        self.protections: dict[str, bool] = {
            "isolated_interpreter": True, "cleared_environment": True, "own_directory": True, "rlimits": True,
            "own_uid": "setuid" in on, "user_namespace": "userns" in on, "private_filesystem": "mounts" in on,
            "no_network": "net" in on, "pid_namespace": "pid" in on, "own_proc": "proc" in on,
            "ipc_namespace": "ipc" in on}

    def describe(self) -> str:
        """One line: the interpreter and which protections are on (and which off, and why)."""
        s, on = self.settings, self._features
        parts = [f"{self.python} (Python {self.python_version}) fresh per call, isolated (-I)", "cleared env",
                 "own empty dir on a private tmpfs, host filesystems read-only" if "mounts" in on else "own empty dir",
                 f"rlimits cpu {s.cpu_s} s/mem {s.memory_mb} MB/fsize {s.file_size_mb} MB/nproc {s.processes}"]
        if "setuid" in on:
            uids = f"{self.uids[0]}-{self.uids[-1]}" if len(self.uids) > 1 else str(self.uids[0])
            parts.append(f"uid {uids} (not root), no_new_privs")
        parts += [{"net": "no network"}.get(f, _WHAT[f]) for f in ("userns", "net", "pid", "proc", "ipc") if f in on]
        off = ([] if self.root else ["own uid (not root: runs as the calling user)"])
        for feature, why in self._off.items():
            off.append(f"{_WHAT[feature]} ({why}; {_OFF_MEANS[feature]})" if feature in _OFF_MEANS else
                       f"{_WHAT[feature]} ({why})")
        return "sandbox: " + ", ".join(parts) + ("; off: " + ", ".join(off) if off else "")

    def run(self, code: str) -> ToolRun:
        uid = self._slots.get()  # a uid of its own for the call; waits while `workers` calls run
        start = time.monotonic()
        try:
            return self._execute(code, uid, self.python, self._features, self.settings.timeout_s)[0]
        except OSError as err:  # no pipe, no temporary directory left: the machine's failure, not the code's
            return ToolRun("", False, f"the sandbox could not start the call: {err}", time.monotonic() - start)
        finally:
            self._slots.put(uid)

    def run_many(self, codes: list[str]) -> list[ToolRun]:
        """Every call at once, up to ``workers``; results in order. Each call ends by its own timeout."""
        if not codes:
            return []
        with concurrent.futures.ThreadPoolExecutor(min(self.settings.workers, len(codes))) as pool:
            return list(pool.map(self.run, codes))

    def close(self):
        """Gives the calls' uids back to other sandboxes of this machine (the process's exit does too)."""
        for fd in self._locks:
            os.close(fd)
        self._locks = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- set-up

    def _claim_uids(self, n: int) -> list[int]:
        """n uids no one uses: no passwd entry, no process, and no other sandbox of this machine holding the lock
        file kept for it (held as long as this sandbox lives; released by the kernel when its process ends)."""
        lock_dir = os.path.join(tempfile.gettempdir(), "grpo-sandbox-uids")
        os.makedirs(lock_dir, mode=0o700, exist_ok=True)
        info = os.lstat(lock_dir)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o022:
            raise SandboxError(f"{lock_dir} is not a directory of root's that only root may write to")
        busy = _uids_with_processes()
        uids = []
        for uid in range(FIRST_UID, LAST_UID + 1):
            if len(uids) == n:
                break
            with contextlib.suppress(KeyError):
                pwd.getpwuid(uid)
                continue
            fd = os.open(os.path.join(lock_dir, str(uid)), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            if uid in busy:  # someone's processes: left alone, never killed
                os.close(fd)
                continue
            uids.append(uid)
            self._locks.append(fd)
        if len(uids) < n:
            self.close()
            raise SandboxError(f"only {len(uids)} free uids in {FIRST_UID}-{LAST_UID} for {n} workers")
        return uids

    def _choose(self) -> tuple[str, str, frozenset[str], dict[str, str]]:
        """The first interpreter the sandbox runs, with every protection the machine allows: a probe call, then one
        fewer protection each time the launcher names one it could not set up."""
        candidates = [self.settings.python] if self.settings.python else [
            "/usr/bin/python3", "/usr/local/bin/python3", sys.executable and os.path.realpath(sys.executable),
            shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")]
        wanted = {"setuid" if self.root else "userns", "mounts", "net", "ipc", "pid", "proc"}
        uid = self._slots.get()
        tried, reasons = set(), []
        try:
            for python in candidates:
                if not python or os.path.realpath(python) in tried:
                    continue
                tried.add(os.path.realpath(python))
                features, off = set(wanted), {}
                while True:
                    run, stage = self._execute(_PROBE_CODE, uid, python, frozenset(features), _PROBE_TIMEOUT_S)
                    words = run.output.split()
                    if run.failed is None and run.exit_code == 0 and len(words) == 2 and (
                            "setuid" not in features or words[0] == str(uid)):
                        return python, words[1], frozenset(features), off
                    if run.failed is not None and stage in features and stage != "setuid":
                        off[stage] = run.failed.split(": ", 1)[-1]
                        features.discard(stage)
                        needing = {"mounts", "net", "ipc", "pid", "proc"} if stage == "userns" else (
                            {"proc"} if stage in ("mounts", "pid") else set())  # /proc is mounted anew in both
                        for feature in needing & features:
                            off[feature] = f"needs the {_WHAT[stage]}"
                        features -= needing
                        continue
                    reasons.append(f"{python}: {run.failed or run.output.strip()[-300:] or 'no output'}")
                    break
        finally:
            self._slots.put(uid)
        raise SandboxError("no interpreter the sandbox can run (" + "; ".join(reasons) + "); install python3 (e.g. "
                           "apt-get install python3) or set SandboxSettings.python to one the sandbox uid may execute")

    # -- one call

    def _execute(self, code: str, uid: int, python: str, features: frozenset[str],
                 timeout_s: float) -> tuple[ToolRun, str | None]:
        """The call's ToolRun, and the stage the launcher blamed when the sandbox failed."""
        s, start = self.settings, time.monotonic()
        deadline = start + timeout_s
        hostdir = None
        if "mounts" not in features:  # no private /tmp: a directory of the host's, removed after the call
            hostdir = tempfile.mkdtemp(prefix="grpo-sandbox-")
            os.chmod(hostdir, 0o755)
        status_r, status_w = os.pipe()
        try:
            argv = [self._launcher, "-I", "-S", "-c", _LAUNCHER, str(status_w), str(uid), repr(deadline),
                    ",".join(sorted(features)), python, hostdir or "", str(s.cpu_s), str(s.memory_mb),
                    str(s.file_size_mb), str(s.processes)]
            try:
                proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        pass_fds=(status_w,), start_new_session=True, env={})
            except OSError as err:
                return ToolRun("", False, f"cannot start the sandbox launcher {self._launcher}: {err}",
                               time.monotonic() - start), "launcher"
            finally:
                os.close(status_w)
            with proc:
                with contextlib.suppress(OSError):  # a launcher that died early: its status says why
                    proc.stdin.write(code.encode("utf-8", errors="replace"))
                with contextlib.suppress(OSError):
                    proc.stdin.close()
                out, err, status, killed = self._collect(proc, status_r, deadline + _GRACE_S)
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)  # not yet reaped: its pid is not anyone else's
                returncode = proc.wait()
        finally:
            os.close(status_r)
            if hostdir:
                shutil.rmtree(hostdir, ignore_errors=True)
        seconds = time.monotonic() - start
        lines = status.decode(errors="replace").splitlines()
        timed_out = killed or "timeout" in lines
        error = next((line.split(" ", 2)[1:] for line in lines if line.startswith("error ")), None)
        end = next((line.split() for line in lines if line.startswith(("exit ", "signal "))), None)
        exit_code = None if end is None or timed_out else int(end[1]) * (-1 if end[0] == "signal" else 1)
        failed, stage = None, None
        if error is not None:
            stage, message = (error + [""])[:2]
            failed = f"{_WHAT.get(stage, stage)}: {message}" if stage != "exec" else \
                f"cannot run {python} in the sandbox: {message}"
            exit_code = None
        elif end is None and not timed_out:
            last = err.decode(errors="replace").strip().splitlines()[-1:] or [""]
            failed = f"the sandbox launcher ended without a result (status {returncode}) {last[0][-200:]}".strip()
        output = _tool_output(out, err, exit_code, timed_out, s.output_chars, s.cpu_s, timeout_s)
        return ToolRun(output, timed_out, failed, seconds, exit_code), stage

    def _collect(self, proc: subprocess.Popen, status_r: int, backstop: float) -> tuple[bytes, bytes, bytes, bool]:
        """Reads the code's stdout and stderr (each bounded: the rest is read and dropped, so a 100 MB print ends
        quickly) and the launcher's status until all three close. A launcher still running at the backstop is
        killed with its process group; True then."""
        keep = _kept_bytes(self.settings.output_chars) + 1  # one byte more: that one says it was cut
        fds = {proc.stdout.fileno(): (bytearray(), keep), proc.stderr.fileno(): (bytearray(), keep),
               status_r: (bytearray(), 1 << 16)}
        killed = False
        with selectors.DefaultSelector() as selector:
            for fd in fds:
                os.set_blocking(fd, False)
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map():
                now = time.monotonic()
                if now >= backstop:
                    if killed or status_r not in selector.get_map():
                        break  # only a process of the caller's own uid (not root, no pid namespace) holds a pipe
                    killed = True
                    with contextlib.suppress(OSError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    backstop = now + _GRACE_S
                for key, _ in selector.select(backstop - now):
                    try:
                        chunk = os.read(key.fd, 1 << 16)
                    except BlockingIOError:
                        continue
                    if not chunk:
                        selector.unregister(key.fd)
                        if key.fd == status_r:  # launcher and reaper done: the code's pipes close at once
                            backstop = min(backstop, time.monotonic() + 0.5)
                        continue
                    buffer, room = fds[key.fd]
                    buffer += chunk[:max(room - len(buffer), 0)]
        return tuple(bytes(buffer) for buffer, _ in fds.values()) + (killed,)


def _tool_output(out: bytes, err: bytes, exit_code: int | None, timed_out: bool, cap: int, cpu_s: int,
                 timeout_s: float) -> str:
    """stdout then stderr, cut to ``cap`` characters (stderr, a traceback, keeps up to half), then markers."""
    kept = _kept_bytes(cap)
    stdout, stderr = (data[:kept].decode("utf-8", errors="replace") for data in (out, err))
    markers = []
    if len(stdout) + len(stderr) > cap or len(out) > kept or len(err) > kept:
        keep_err = min(len(stderr), cap // 2)
        keep_out = min(len(stdout), cap - keep_err)
        stdout, stderr = stdout[:keep_out], stderr[:cap - keep_out]
        markers.append(f"[output cut at {cap} characters]")
    text = stdout + ("\n" if stdout and stderr and not stdout.endswith("\n") else "") + stderr
    if exit_code is not None and exit_code < 0:
        name = _signal_name(-exit_code)
        markers.append(f"[killed by {name}" + (f": CPU time limit of {cpu_s} s]" if name == "SIGXCPU" else "]"))
    elif exit_code and not stderr:  # a traceback already says why
        markers.append(f"[exit status {exit_code}]")
    if timed_out:
        markers.append(f"[timed out after {float(timeout_s)} s]")
    if markers:
        text += ("\n" if text and not text.endswith("\n") else "") + "\n".join(markers)
    return text


def _kept_bytes(chars: int) -> int:
    return 4 * chars + 4  # a character is at most 4 bytes of UTF-8


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _uids_with_processes() -> set[int]:
    uids = set()
    for pid in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError, StopIteration), open(f"/proc/{pid}/status", "rb") as f:
            uids.update(int(u) for u in next(line for line in f if line.startswith(b"Uid:")).split()[1:])
    return uids


def main(argv: list[str] | None = None) -> int:
    """``grpo-sandbox FILE``: runs FILE as a model's tool call would run and prints the tool's answer. Exits 0
    whatever the code did; 1, with one line on stderr, when the sandbox itself cannot run it."""
    defaults = SandboxSettings()
    parser = argparse.ArgumentParser(prog="grpo-sandbox", description="Runs FILE as a model's tool call would run "
                                     "and prints the tool's answer; exits 0 whatever the code did.")
    parser.add_argument("file", help="the Python file to run")
    for name in ("timeout_s", "cpu_s", "memory_mb", "file_size_mb", "processes", "output_chars"):
        value = getattr(defaults, name)
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value, help=f"default {value}")
    parser.add_argument("--python", help="the sandbox's interpreter (default: the first system python3 that works)")
    parser.add_argument("--describe", action="store_true", help="print which protections are on (stderr) first")
    args = parser.parse_args(argv)
    try:
        with open(args.file, "rb") as f:
            code = f.read().decode("utf-8", errors="replace")
    except OSError as err:
        parser.error(f"cannot read {args.file}: {err.strerror}")
    try:
        settings = SandboxSettings(workers=1, **{k: v for k, v in vars(args).items() if k not in ("file", "describe")})
        with Sandbox(settings) as sandbox:
            if args.describe:
                print(sandbox.describe(), file=sys.stderr, flush=True)
            run = sandbox.run(code)
    except (SandboxError, ValueError, OSError) as err:
        print(f"grpo-sandbox: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    if run.failed is not None:
        print(f"grpo-sandbox: {' '.join(run.failed.split())}", file=sys.stderr)
        return 1
    sys.stdout.write(run.output + ("" if run.output.endswith("\n") or not run.output else "\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
