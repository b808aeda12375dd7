"""The code sandbox contains what untrusted code does: loops, fork bombs, output,
memory, files, and it sees none of the server's environment or private files.

The escape tests start a small "server" process (`_DRIVER`) that runs one piece of hostile
code through `run_python`, as root and as an unprivileged user (`nobody`, when these tests run
as root; else the user running them), and check what the code reached from the outside.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from tiderl.envs import sandbox
from tiderl.envs.memory_watch import MemoryWatch
from tiderl.envs.uids import processes_of_uid
from tiderl.envs.sandbox import (
    Isolation,
    SandboxLimits,
    SandboxUnavailableError,
    bwrap_argv,
    cgroup_candidates,
    check_bwrap,
    exit_code_of_bwrap,
    run_python,
)

ROOT = Path(__file__).resolve().parents[1]
is_root = os.geteuid() == 0
needs_root = pytest.mark.skipif(not is_root, reason="own-uid containment needs root")
NOBODY = 65534
UID_BASE = 1_900_100_000
LIMITS = SandboxLimits(wall_s=5.0, cpu_s=2, uid_base=UID_BASE, uid_slots=4)


def _bwrap_missing() -> str | None:
    try:
        check_bwrap(LIMITS)
    except SandboxUnavailableError as e:
        return str(e)
    return None


BWRAP_MISSING = _bwrap_missing()
needs_bwrap = pytest.mark.skipif(BWRAP_MISSING is not None, reason=f"bwrap cannot run here: {BWRAP_MISSING}")
ISOLATIONS = [pytest.param(Isolation.BWRAP, marks=needs_bwrap, id="bwrap"), pytest.param(Isolation.UNSAFE, id="unsafe")]


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_runs_code_and_captures_output_and_errors(isolation: Isolation) -> None:
    result = run_python("import math\nprint(math.gcd(12, 18))\nraise ValueError('bad')\n", LIMITS, isolation)
    assert result.stdout == "6\n"
    assert result.exit_code == 1 and not result.timed_out and not result.ok
    assert 'File "main.py", line 3' in result.stderr and "ValueError: bad" in result.stderr
    assert run_python("print('hi')", LIMITS, isolation).ok


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_empty_environment_and_scratch_directory(isolation: Isolation, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDERL_ENV_TOKEN", "server-secret")
    code = "import os\nprint(sorted(os.environ))\nprint(os.getcwd())\nprint(os.listdir('.'))"
    env_keys, cwd, listing = run_python(code, LIMITS, isolation).stdout.splitlines()
    assert "TIDERL_ENV_TOKEN" not in env_keys and "PATH" not in env_keys
    assert listing == "['main.py']"
    if isolation is Isolation.BWRAP:
        assert cwd == "/tmp"  # the run's own tmpfs
    else:
        assert "tiderl-sandbox-" in cwd
        assert not Path(cwd).exists()  # the scratch directory is deleted afterwards


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_infinite_loop_is_stopped_by_cpu_or_wall_limit(isolation: Isolation) -> None:
    limits = SandboxLimits(cpu_s=1, wall_s=3.0, uid_base=UID_BASE, uid_slots=4)
    result = run_python("while True:\n    pass\n", limits, isolation)
    assert result.exit_code is not None and result.exit_code < 0
    assert result.wall_s < 5.0


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_sleeping_code_is_stopped_by_wall_limit(isolation: Isolation) -> None:
    limits = SandboxLimits(wall_s=1.0, uid_base=UID_BASE, uid_slots=4)
    result = run_python("import time\ntime.sleep(60)\n", limits, isolation)
    assert result.timed_out and result.exit_code == -signal.SIGKILL and result.wall_s < 3.0


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_huge_output_is_capped(isolation: Isolation) -> None:
    limits = SandboxLimits(output_bytes=10_000, wall_s=5.0, uid_base=UID_BASE, uid_slots=4)
    result = run_python("while True:\n    print('x' * 1000)\n", limits, isolation)
    assert result.output_truncated and len(result.stdout) + len(result.stderr) <= 10_000
    assert result.wall_s < 4.0


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_memory_hog_gets_memory_error(isolation: Isolation) -> None:
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))\n"
    result = run_python(code, SandboxLimits(memory_mb=256, uid_base=UID_BASE, uid_slots=4), isolation)
    assert result.exit_code == 1 and "MemoryError" in result.stderr


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_big_file_is_refused(isolation: Isolation) -> None:
    code = "with open('big', 'wb') as f:\n    f.write(b'x' * (8 << 20))\nprint('wrote')\n"
    result = run_python(code, SandboxLimits(file_mb=1, uid_base=UID_BASE, uid_slots=4), isolation)
    assert "wrote" not in result.stdout and result.exit_code != 0


@needs_root
@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_fork_bomb_is_capped_and_every_process_is_killed(isolation: Isolation) -> None:
    code = (
        "import os, time\n"
        "for _ in range(10000):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            os.setsid()\n"  # escape the process group: the uid sweep must still get it
        "            time.sleep(600)\n"
        "    except OSError:\n"
        "        pass\n"
        "print('forks refused')\n"
        "time.sleep(600)\n"
    )
    limits = SandboxLimits(wall_s=3.0, max_processes=8, uid_base=UID_BASE, uid_slots=1)
    result = run_python(code, limits, isolation)
    assert result.timed_out and "forks refused" in result.stdout
    assert processes_of_uid(UID_BASE) == {}  # no process left, not even a zombie


@needs_root
@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_server_private_files_are_unreadable(isolation: Isolation, tmp_path: Path) -> None:
    secret = tmp_path / "token"
    secret.write_text("server-secret")
    secret.chmod(0o600)
    result = run_python(f"print(open({str(secret)!r}).read())", LIMITS, isolation)
    assert "server-secret" not in result.stdout
    assert ("PermissionError" if isolation is Isolation.UNSAFE else "FileNotFoundError") in result.stderr
    assert run_python("import os\nprint(os.getuid())", LIMITS, isolation).stdout.strip().startswith("19001000")


# The command line and the parsers, from literal values ---------------------------------


def test_bwrap_argv_isolates_and_binds_only_what_a_run_needs() -> None:
    argv = bwrap_argv("/usr/bin/bwrap", system_mounts=["--ro-bind", "/usr", "/usr"],
                      python_dirs=["/home/ann/.pyenv/versions/3.11.7", "/srv/proj/.venv"], tmpfs_mb=64,
                      code_fd=5, info_fd=6, sync_fd=7, as_root=False)
    text = " ".join(argv)
    assert argv[:5] == ["/usr/bin/bwrap", "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session"]
    assert argv[-1] == "--" and "--share-net" not in argv
    assert f"--perms 1777 --size {64 << 20} --tmpfs /tmp" in text
    assert f"--perms 1777 --size {64 << 20} --tmpfs /dev/shm" in text
    # Only the install is bound (read-only), under parents the run's uid may enter; not the home itself.
    assert "--ro-bind /home/ann/.pyenv/versions/3.11.7 /home/ann/.pyenv/versions/3.11.7" in text
    assert "--ro-bind /srv/proj/.venv /srv/proj/.venv" in text
    assert "--perms 0755 --dir /home/ann" in text and "--perms 0755 --dir /home/ann/.pyenv" in text
    assert [a for a in argv if a.startswith("--bind")] == []  # nothing of the host is writable
    assert text.endswith("--remount-ro /dev --remount-ro / --chdir /tmp --")
    assert "--disable-userns" in argv and "--block-fd 7" in text and "--file 5 /tmp/main.py" in text


def test_bwrap_argv_as_root_waits_for_the_uid_map_and_keeps_only_setuid() -> None:
    argv = bwrap_argv("bwrap", system_mounts=[], python_dirs=[], tmpfs_mb=8, code_fd=5, info_fd=6, sync_fd=7,
                      as_root=True)
    text = " ".join(argv)
    assert "--userns-block-fd 7" in text and "--disable-userns" not in argv
    assert "--cap-drop ALL --cap-add CAP_SETUID --cap-add CAP_SETGID" in text


def test_exit_status_of_bwrap_gives_the_signal() -> None:
    assert [exit_code_of_bwrap(s) for s in (0, 1, 128, 137, 152, 255)] == [0, 1, 128, -9, -24, 255]


MOUNTINFO_V1 = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
CGROUP_V1 = "8:pids:/\n4:memory:/process_api/0846\n1:cpu:/\n0::/\n"


def test_cgroup_directories_are_found_from_proc_text() -> None:
    assert cgroup_candidates(MOUNTINFO_V1, CGROUP_V1) == {
        "memory": Path("/sys/fs/cgroup/memory/process_api/0846"),
        "pids": Path("/sys/fs/cgroup/pids"),
        "v2": Path("/sys/fs/cgroup/unified"),
    }
    v2 = "29 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
    assert cgroup_candidates(v2, "0::/system.slice/slurmd.service\n") == {
        "v2": Path("/sys/fs/cgroup/system.slice/slurmd.service")}
    # A container mounts its own cgroup as the root of the hierarchy.
    nested = "29 23 0:26 /docker/abc /sys/fs/cgroup ro - cgroup2 cgroup2 rw\n"
    assert cgroup_candidates(nested, "0::/docker/abc/job\n") == {"v2": Path("/sys/fs/cgroup/job")}


def test_a_v2_cgroup_with_the_server_in_it_moves_the_server_to_a_leaf(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # A fake cgroupfs that refuses controllers for children while the cgroup holds processes.
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("")
    (tmp_path / "cgroup.procs").write_text(f"{os.getpid()}\n")

    def write(path: Path, text: str) -> None:
        if path.name == "cgroup.subtree_control" and (tmp_path / "cgroup.procs").read_text().strip():
            raise OSError(16, "Device or resource busy")
        if path.name == "cgroup.procs" and path.parent != tmp_path:
            (tmp_path / "cgroup.procs").write_text("")  # the process leaves the parent
        path.write_text(text)

    from tiderl.envs.cgroups import enable_v2

    assert enable_v2(tmp_path, write=write)
    assert (tmp_path / "tiderl-server" / "cgroup.procs").read_text() == str(os.getpid())
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+memory +pids"
    (tmp_path / "cgroup.subtree_control").write_text("")
    (tmp_path / "cgroup.procs").write_text(f"{os.getpid()}\n1\n")  # not alone: nothing moves
    assert not enable_v2(tmp_path, write=write)


def test_a_python_install_holding_the_home_directory_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    home = os.path.realpath(os.path.expanduser("~"))
    for name in ("prefix", "exec_prefix", "base_prefix", "base_exec_prefix"):
        monkeypatch.setattr(sys, name, home)
    with pytest.raises(SandboxUnavailableError, match="home directory"):
        sandbox.python_dirs()


def test_bwrap_missing_or_failing_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "_bwrap_checked", False)
    monkeypatch.setattr(sandbox, "find_bwrap", lambda: None)
    with pytest.raises(SandboxUnavailableError, match="bubblewrap .* not installed"):
        run_python("print(1)", LIMITS)
    monkeypatch.setattr(sandbox, "find_bwrap", lambda: "/bin/false")
    with pytest.raises(SandboxUnavailableError, match="cannot make a sandbox here"):
        check_bwrap(LIMITS)
    assert run_python("print(1)", LIMITS, Isolation.UNSAFE).stdout == "1\n"  # unsafe needs no bwrap


# Escapes, run from a server process as root and as an unprivileged user -----------------

_DRIVER = r"""
import json, os, sys
from tiderl.envs import sandbox
limits, code = json.loads(sys.argv[1]), sys.argv[2].replace("SERVER_PID", str(os.getpid()))
r = sandbox.run_python(code, sandbox.SandboxLimits(**limits))
cgroup = sandbox.cgroup_parent() is not None if hasattr(sandbox, "cgroup_parent") else False
print(json.dumps({"stdout": r.stdout, "stderr": r.stderr, "exit_code": r.exit_code, "cgroup": cgroup,
                  "memory_exceeded": getattr(r, "memory_exceeded", False)}))
"""
USERS = ["root", "unprivileged"]


def _drop_to(uid: int | None) -> dict[str, object]:
    return {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}


@functools.cache
def _python_for(uid: int | None) -> str | None:
    """A Python that `uid` may run and that imports tiderl from this checkout."""
    if uid is None:
        return sys.executable
    for python in (sys.executable, os.path.realpath(sys.executable), "/usr/bin/python3"):
        try:
            probe = subprocess.run([python, "-c", "import tiderl.envs.sandbox"], env={"PYTHONPATH": str(ROOT)},
                                   cwd="/", capture_output=True, **_drop_to(uid))  # type: ignore[call-overload]
        except OSError:
            continue  # e.g. under a home directory that uid may not enter
        if probe.returncode == 0:
            return python
    return None


def _server_uid(user: str) -> int | None:
    """The uid the server process runs as (None: this process's own)."""
    if user == "root":
        if not is_root:
            pytest.skip("needs root")
        return None
    return NOBODY if is_root else None


def _serve(user: str, code: str, **limits: object) -> dict[str, object]:
    """Run `code` through `run_python` in a fresh server process of `user`; fails if that process died."""
    uid = _server_uid(user)
    python = _python_for(uid)
    if python is None:
        pytest.skip(f"no Python that uid {uid} may run imports tiderl from {ROOT}")
    args = json.dumps({"uid_base": UID_BASE, "uid_slots": 4, "wall_s": 10.0, **limits})
    env = {"PYTHONPATH": str(ROOT), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    proc = subprocess.run([python, "-c", _DRIVER, args, code], env=env, cwd="/", capture_output=True, text=True,
                          timeout=120, **_drop_to(uid))  # type: ignore[call-overload]
    if "SandboxUnavailableError" in proc.stderr and BWRAP_MISSING is None:
        pytest.skip(f"bwrap cannot run as uid {uid} here: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, f"the server process died (exit {proc.returncode}): {proc.stderr[-2000:]}"
    return json.loads(proc.stdout.splitlines()[-1])


def _pids_with_argv0(marker: str) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    if f.read().split(b"\0")[0] == marker.encode():
                        found.append(int(entry.name))
            except OSError:
                continue
    return found


@needs_bwrap
@pytest.mark.parametrize("user", USERS)
def test_the_servers_token_file_and_home_are_out_of_sight(user: str) -> None:
    uid = _server_uid(user)
    run_dir = Path(tempfile.mkdtemp(prefix="tiderl-test-run-", dir="/var/tmp"))
    token = run_dir / "env.token"
    token.write_text("token-secret")
    token.chmod(0o600)
    paths = [token, run_dir]
    home_secret = None
    if uid is None and Path.home().is_dir():
        home_secret = Path(tempfile.mkstemp(prefix="tiderl-test-", dir=Path.home())[1])
        home_secret.write_text("home-secret")
        paths.append(home_secret)
    if uid is not None:
        for path in (run_dir, token):
            os.chown(path, uid, uid)
    code = (
        "import os\n"
        f"for path in {[str(p) for p in paths]!r}:\n"
        "    try:\n"
        "        print(os.listdir(path) if os.path.isdir(path) else open(path).read())\n"
        "    except OSError as e:\n"
        "        print(type(e).__name__)\n"
    )
    try:
        result = _serve(user, code)
    finally:
        token.unlink()
        run_dir.rmdir()
        if home_secret is not None:
            home_secret.unlink()
    assert "secret" not in result["stdout"] and "env.token" not in result["stdout"]
    assert result["stdout"].split() == ["FileNotFoundError"] * len(paths)


@needs_bwrap
@pytest.mark.parametrize("user", USERS)
def test_a_child_in_a_session_of_its_own_dies_with_the_run(user: str) -> None:
    marker = f"tiderl-escape-{uuid.uuid4().hex[:12]}"
    code = (
        "import os\n"
        "r, w = os.pipe()\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv('/bin/sleep', [{marker!r}, '60'])\n"
        "    os._exit(0)\n"
        "os.close(w)\n"
        "os.read(r, 1)\n"  # EOF once the grandchild has exec'd (the pipe closes on exec)
        "print('escaped')\n"
    )
    try:
        result = _serve(user, code)
        assert result["stdout"] == "escaped\n"
        assert _pids_with_argv0(marker) == []
    finally:
        for pid in _pids_with_argv0(marker):
            os.kill(pid, signal.SIGKILL)


@needs_bwrap
@pytest.mark.parametrize("user", USERS)
def test_the_run_cannot_kill_the_server(user: str) -> None:
    code = (
        "import os, signal\n"
        "for pid in (os.getppid(), SERVER_PID, -1):\n"
        "    try:\n"
        "        os.kill(pid, signal.SIGKILL)\n"
        "    except OSError as e:\n"
        "        print(type(e).__name__)\n"
        "print('still here')\n"
    )
    result = _serve(user, code)  # asserts that the server process lived on
    assert result["stdout"].endswith("still here\n")


@needs_bwrap
@pytest.mark.parametrize("user", USERS)
def test_tmp_and_dev_shm_are_private_to_a_run_and_capped(user: str) -> None:
    marker = f"tiderl-test-{uuid.uuid4().hex[:12]}"
    fill = (
        "import os\n"
        "for d in ('/tmp', '/dev/shm'):\n"
        f"    open(d + '/{marker}', 'w').write('x')\n"
        "written_mb = 0\n"
        "try:\n"
        "    for i in range(10):\n"  # 160 MB, in files of 16 MB (the file size limit)
        f"        with open('/dev/shm/{marker}-' + str(i), 'wb') as f:\n"
        "            f.write(b'x' * (16 << 20))\n"
        "        written_mb += 16\n"
        "except OSError as e:\n"
        "    print('errno', e.errno)\n"
        "print('written_mb', written_mb)\n"
    )
    look = ("import os\n"
            f"print(sorted(n for d in ('/tmp', '/dev/shm') for n in os.listdir(d) if n.startswith({marker!r})))\n")
    try:
        filled = _serve(user, fill)
        looked = _serve(user, look)
        left_on_host = [p for d in ("/tmp", "/dev/shm") for p in Path(d).glob(marker + "*")]
    finally:
        for d in ("/tmp", "/dev/shm"):
            for path in Path(d).glob(marker + "*"):
                path.unlink()
    assert left_on_host == [] and looked["stdout"] == "[]\n"
    written_mb = int(filled["stdout"].split()[-1])
    assert written_mb <= SandboxLimits().tmpfs_mb and f"errno {28}" in filled["stdout"]  # ENOSPC


@needs_bwrap
@pytest.mark.parametrize("user", USERS)
def test_the_run_has_no_network(user: str) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        connect = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=5)\nprint('connected')\n"
        code = f"import os, sys\nos.execv(sys.executable, [sys.executable, '-c', {connect!r}])\n"
        result = _serve(user, code)
    assert "connected" not in result["stdout"] and "ConnectionRefusedError" in result["stderr"]


_HOLD = """
import os, time
report_r, report_w = os.pipe()
gate_r, gate_w = os.pipe()
children = []
for i in range(4):
    pid = os.fork()
    if pid == 0:
        os.close(gate_w)
        data = b"x" * (150 << 20)
        os.write(report_w, bytes([i]))
        os.read(gate_r, 1)  # hold the memory until the gate opens (EOF)
        os._exit(0)
    children.append(pid)
os.close(report_w)
os.close(gate_r)
os.set_blocking(report_r, False)
reported, dead = set(), set()
while len(reported | dead) < 4:
    try:
        reported.update(os.read(report_r, 16))
    except BlockingIOError:
        pass
    for i, pid in enumerate(children):
        if i not in dead and os.waitpid(pid, os.WNOHANG)[0]:
            dead.add(i)
    time.sleep(0.01)
os.close(gate_w)
statuses = [os.waitpid(pid, 0)[1] for i, pid in enumerate(children) if i not in dead]
print("held at once:", sum(1 for s in statuses if os.WIFEXITED(s) and os.WEXITSTATUS(s) == 0))
"""


@needs_bwrap
@pytest.mark.parametrize("user", USERS)
def test_one_memory_limit_holds_for_all_processes_of_a_run(user: str) -> None:
    # Four processes of 150 MB each fit the 256 MB per-process limit, not one limit for the run.
    result = _serve(user, _HOLD, memory_mb=256, max_processes=8)
    if result["cgroup"] or _server_uid(user) is None and sandbox.cgroup_parent() is not None:
        # The cgroup's limit kills a process; the run goes on and reports.
        assert result["memory_exceeded"] and result["stdout"] in ("held at once: 0\n", "held at once: 1\n"), result
    else:
        # No writable cgroup: the server's MemoryWatch sums the run's memory and kills the whole run.
        assert result["memory_exceeded"] and result["stdout"] in ("", "held at once: 0\n", "held at once: 1\n"), result


def test_the_memory_watch_sums_a_process_tree_and_its_tmpfs() -> None:
    import psutil  # the test's yardstick; the watch reads /proc itself

    # Without a namespace: this process and its children are the "run"; /dev/shm (a tmpfs) its tmpfs.
    hold = subprocess.Popen([sys.executable, "-c", "import time; data = b'x' * (64 << 20); time.sleep(30)"])
    shm = Path("/dev/shm") / f"tiderl-watch-{uuid.uuid4().hex}"
    try:
        watch = MemoryWatch(os.getpid(), limit_bytes=1 << 40, tmpfs=())
        deadline = time.monotonic() + 30
        while watch.used_bytes() < psutil.Process().memory_info().rss + (60 << 20):
            assert time.monotonic() < deadline, "the child's 64 MB never showed in the sum"
            time.sleep(0.1)
        assert not watch.exceeded()
        assert MemoryWatch(os.getpid(), limit_bytes=1 << 20, tmpfs=()).exceeded()
        assert MemoryWatch(2 ** 22 + 12345, limit_bytes=1).used_bytes() == 0  # no such process
        files = MemoryWatch(os.getpid(), limit_bytes=1 << 40, tmpfs=("dev/shm",))
        before = files.used_bytes()
        shm.write_bytes(b"y" * (32 << 20))  # a file in the tmpfs is memory too
        assert files.used_bytes() >= before + (30 << 20)
    finally:
        shm.unlink(missing_ok=True)
        hold.kill()
        hold.wait()


@needs_bwrap
@pytest.mark.parametrize("user", USERS)
def test_fork_bomb_is_capped_inside_the_namespace(user: str) -> None:
    # The server's user already has processes elsewhere: they must not use up the run's cap.
    uid = _server_uid(user)
    others = [subprocess.Popen(["sleep", "60"], **_drop_to(uid)) for _ in range(20)]  # type: ignore[call-overload]
    code = (
        "import os, time\n"
        "forks = 0\n"
        "try:\n"
        "    for _ in range(100):\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(60)\n"
        "        forks += 1\n"
        "except OSError:\n"
        "    pass\n"
        "print(forks)\n"
    )
    try:
        result = _serve(user, code, max_processes=6)
    finally:
        for proc in others:
            proc.kill()
            proc.wait()
    assert 0 < int(result["stdout"]) < 6


@needs_root
@needs_bwrap
def test_a_runs_cgroup_is_removed_afterwards() -> None:
    parent = sandbox.cgroup_parent()
    if parent is None:
        pytest.skip("no writable cgroup here")
    assert run_python("print(1)", LIMITS).stdout == "1\n"
    left = [p for d in {parent.memory_dir, parent.pids_dir} for p in d.glob(f"tiderl-sandbox-{os.getpid()}-*")]
    assert left == []
