"""Attack campaign against a real `tiderl env serve` (issue 48): one JSON line per case,
{"case", "blocked", "evidence"}.

    .venv/bin/python tools/attack.py --all
    .venv/bin/python tools/attack.py --case slowloris_health

Each case is a function taking a `Target` (a started server and how to reach it) and returning
that dict. `CASES` lists them; a sibling module `tools/attack_store.py` that defines `CASES`
(callables taking no argument, returning such dicts) is run too. Cases that need an ordinary
user run their attacker as one: as root the tool creates the user `tiderl-attack` (useradd)
or uses `nobody`, and says so; without root it runs them as the current user and says so.

As root, `--all` runs the campaign twice: as root, then as that ordinary user (`--as both`, the
default there), so the unprivileged server's defences are tried too. The second run is this tool
again under `setpriv` in a private mount namespace, where a directory that keeps the user from the
interpreter, the venv or the checkout (a home directory of mode 0700) is covered by a tmpfs holding
only those paths; nothing outside the namespace changes. Each line names who ran it (`as`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class Target:
    """A `tiderl env serve` started for the campaign (loopback or every interface, with a token or not)."""

    def __init__(self, *extra: str, host: str = "127.0.0.1", token: str | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="tiderl-attack-"))
        env = {k: v for k, v in os.environ.items() if k != "TIDERL_ENV_TOKEN"}
        argv = [sys.executable, "-m", "tiderl", "env", "serve", "--env", "hilo,pytool", "--host", host,
                "--port-file", str(self.dir / "url"), *extra]
        if token is not None:
            (self.dir / "token").write_text(token)
            os.chmod(self.dir / "token", 0o600)
            argv += ["--token-file", str(self.dir / "token")]
        self.token = token
        TOKEN[:] = [token] if token else []
        self.proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not (self.dir / "url").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tiderl env serve did not start (exit {self.proc.poll()})")
            time.sleep(0.1)
        self.port = int((self.dir / "url").read_text().strip().rsplit(":", 1)[1])

    def url(self, address: str = "127.0.0.1") -> str:
        return f"http://{address}:{self.port}"

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        subprocess.run(["rm", "-rf", str(self.dir)], check=False)


TOKEN: list[str] = []  # the started server's


async def _post(url: str, body: Any, *, local: str | None = None, with_token: bool = True) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {TOKEN[0]}"} if TOKEN and with_token else {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(local, 0) if local else None)) as http:
        async with http.post(url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=60)) as resp:
            return resp.status, await resp.json()


def _other_address() -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            address = s.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address


def case_unsafe_sandbox(t: Target) -> dict[str, Any]:
    status, answer = asyncio.run(_post(t.url() + "/start", {"env": "pytool", "seed": 1,
                                                            "options": {"sandbox": "unsafe"}}))
    return {"blocked": status == 403, "evidence": f"{status} {answer.get('code')}: {answer.get('error')}"}


def case_no_token_wide(t: Target) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "TIDERL_ENV_TOKEN"}
    proc = subprocess.run([sys.executable, "-m", "tiderl", "env", "serve", "--env", "hilo", "--host", "0.0.0.0"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    return {"blocked": proc.returncode == 2, "evidence": f"exit {proc.returncode}: {proc.stderr.strip()[-200:]}"}


def case_huge_option(t: Target) -> dict[str, Any]:
    status, answer = asyncio.run(_post(t.url() + "/start", {"env": "hilo", "seed": 1, "options": {"high": 10**4000}}))
    return {"blocked": status == 400 and answer.get("code") == "bad_options", "evidence": f"{status} {answer}"[:300]}


def case_slow_dataset(t: Target) -> dict[str, Any]:
    config = {"min_terms": 20000, "max_terms": 20000, "min_digits": 500, "max_digits": 500}
    t0 = time.monotonic()
    status, answer = asyncio.run(_post(t.url() + "/start", {"env": "pytool", "seed": 1,
                                                            "options": {"dataset_config": config}}))
    took = time.monotonic() - t0
    return {"blocked": status == 400 and took < 75, "evidence": f"{status} after {took:.1f} s: {answer.get('error')}"[:300]}


def case_session_binding(t: Target) -> dict[str, Any]:
    other = _other_address()
    if other is None:
        return {"blocked": None, "evidence": "no non-loopback address here to be a second client"}

    async def main() -> tuple[int, int]:
        _, started = await _post(t.url() + "/start", {"env": "hilo", "seed": 1})
        # Another client: another address, without the token (every holder of the token is the run itself).
        status, _ = await _post(t.url(other) + "/end", {"session_id": started["session_id"]}, local=other,
                                with_token=False)
        mine, _ = await _post(t.url() + "/end", {"session_id": started["session_id"]})
        return status, mine

    status, mine = asyncio.run(main())
    return {"blocked": status in (401, 404) and mine == 200, "evidence": f"another client's /end: {status}; the owner's: {mine}"}


def case_slowloris_health(t: Target, connections: int = 2000, probes: int = 100) -> dict[str, Any]:
    other = _other_address()
    if other is None:
        return {"blocked": None, "evidence": "no non-loopback address here to be a second client"}

    async def main() -> tuple[int, float, int]:
        held: list[asyncio.StreamWriter] = []
        stop = asyncio.Event()

        async def flood() -> None:  # keep `connections` half-open, reopening what the server closes
            while not stop.is_set():
                for w in [w for w in held if w.is_closing() or w.transport.is_closing()]:
                    held.remove(w)
                while len(held) < connections and not stop.is_set():
                    try:
                        _, w = await asyncio.open_connection("127.0.0.1", t.port)
                        w.write(b"POST /start HTTP/1.1\r\nHost: x\r\n")
                        held.append(w)
                    except OSError:
                        await asyncio.sleep(0.01)
                        break
                await asyncio.sleep(0.05)

        task = asyncio.create_task(flood())
        await asyncio.sleep(3.0)
        ok, worst = 0, 0.0
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(other, 0), force_close=True)) as http:
            for _ in range(probes):
                t0 = time.monotonic()
                try:
                    async with http.get(t.url(other) + "/health", headers={"Authorization": f"Bearer {t.token}"},
                                        timeout=aiohttp.ClientTimeout(total=1.0)) as r:
                        ok += r.status == 200 and time.monotonic() - t0 < 1.0
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    pass
                worst = max(worst, time.monotonic() - t0)
                await asyncio.sleep(0.02)
        stop.set()
        await task
        for w in held:
            w.close()
        return ok, worst, len(held)

    ok, worst, held = asyncio.run(main())
    return {"blocked": ok == probes, "evidence": f"{ok}/{probes} health probes within 1 s (slowest {worst:.3f} s) "
                                                f"while one client kept {connections} half-open connections going"}


def _ordinary_user() -> tuple[int | None, str]:
    if os.geteuid() != 0:
        return None, f"not root: ran as the current user {pwd.getpwuid(os.getuid()).pw_name}"
    try:
        return pwd.getpwnam("tiderl-attack").pw_uid, "ran as the user tiderl-attack"
    except KeyError:
        pass
    made = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "tiderl-attack"],
                          capture_output=True, text=True)
    if made.returncode == 0:
        return pwd.getpwnam("tiderl-attack").pw_uid, "created the user tiderl-attack and ran as it"
    return 65534, f"useradd failed ({made.stderr.strip()[:80]}): ran as nobody"


def case_shared_memory_unprivileged(t: Target) -> dict[str, Any]:
    uid, how = _ordinary_user()
    code = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "print('shmget', libc.shmget(0, 1200 << 20, 0o1000 | 0o600))\n"
            "try:\n    os.memfd_create('x'); print('memfd made')\nexcept OSError as e:\n    print('memfd', e.errno)\n")
    driver = ("import sys, json\nsys.path.insert(0, %r)\nfrom tiderl.envs.sandbox import run_python, SandboxLimits\n"
              "r = run_python(sys.argv[1], SandboxLimits(wall_s=5, uid_base=1_900_400_000, uid_slots=2))\n"
              "print(json.dumps(r.stdout))\n" % str(ROOT))
    drop = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
    proc = subprocess.run(["/usr/bin/python3" if uid is not None else sys.executable, "-c", driver, code],
                          capture_output=True, text=True, timeout=60, cwd="/", **drop)  # type: ignore[call-overload]
    out = json.loads(proc.stdout.splitlines()[-1]) if proc.returncode == 0 and proc.stdout else proc.stderr[-200:]
    return {"blocked": "shmget -1" in out and "memfd made" not in out, "evidence": f"{how}: {out!r}"[:300]}


def case_lock_dir_private(t: Target) -> dict[str, Any]:
    from tiderl.envs.uids import LOCK_DIR

    if os.geteuid() != 0:
        return {"blocked": True, "evidence": "not root: no uid slots are locked"}
    parent = os.stat(LOCK_DIR.parent)
    st = os.lstat(LOCK_DIR) if LOCK_DIR.exists() else None
    ok = parent.st_uid == 0 and not parent.st_mode & 0o022 and (st is None or (st.st_uid == 0 and not st.st_mode & 0o077))
    return {"blocked": ok, "evidence": f"{LOCK_DIR}: parent mode {parent.st_mode & 0o7777:04o} uid {parent.st_uid}; "
                                       f"dir {'absent' if st is None else f'{st.st_mode & 0o7777:04o} uid {st.st_uid}'}"}


CASES: list[Callable[[Target], dict[str, Any]]] = [
    case_unsafe_sandbox, case_no_token_wide, case_huge_option, case_slow_dataset, case_session_binding,
    case_slowloris_health, case_shared_memory_unprivileged, case_lock_dir_private,
]


def _reach_script(uid: int, argv: list[str], home: str, stage_root: str) -> str:
    """A shell script for `unshare --mount` that makes the interpreter, the venv and the checkout reachable
    for `uid` (each directory on their way that others cannot enter is covered by a 0755 tmpfs holding
    only the needed entries, bound from their originals), then runs `argv` as `uid` with `home`."""
    import shlex

    cover: dict[Path, set[str]] = {}
    for need in {Path(sys.base_prefix), Path(sys.prefix), ROOT}:
        parts = need.resolve().parts
        for depth in range(1, len(parts) - 1):
            d = Path(*parts[:depth + 1])
            st = os.stat(d)
            if not st.st_mode & 0o001 and st.st_uid != uid:
                cover.setdefault(d, set()).add(parts[depth + 1])
                break
    lines = ["set -e", "mount --make-rprivate /"]
    for n, (d, names) in enumerate(sorted(cover.items())):
        stage = tempfile.mkdtemp(dir=stage_root)
        for name in sorted(names):
            q = shlex.quote
            lines += [f"mkdir -p {q(stage)}/{q(name)}", f"mount --bind {q(str(d / name))} {q(stage)}/{q(name)}"]
        lines.append(f"mount -t tmpfs -o mode=0755,size=1m tiderl-reach{n} {shlex.quote(str(d))}")
        for name in sorted(names):
            q = shlex.quote
            lines += [f"mkdir {q(str(d / name))}", f"mount --move {q(stage)}/{q(name)} {q(str(d / name))}"]
    env = f"HOME={home} PATH=/usr/local/bin:/usr/bin:/bin TMPDIR=/tmp LANG=C.UTF-8"
    lines.append(f"exec setpriv --reuid={uid} --regid={uid} --clear-groups -- env -i {env} "
                 + " ".join(shlex.quote(a) for a in argv))
    return "\n".join(lines)


def _as_ordinary_user(argv: list[str]) -> int:
    """Run this tool with `argv` as the ordinary user (root only); its lines are passed on. Exit status 1
    when a case was not blocked or the run could not be made."""
    uid, how = _ordinary_user()
    assert uid is not None
    home = tempfile.mkdtemp(prefix="tiderl-attack-home-")
    os.chown(home, uid, uid)
    stages = tempfile.mkdtemp(prefix="tiderl-attack-reach-")  # where the namespace parks its binds
    script = _reach_script(uid, [sys.executable, str(Path(__file__).resolve()), *argv], home, stages)
    try:
        proc = subprocess.run(["unshare", "--mount", "sh", "-c", script], cwd="/", stdout=subprocess.PIPE, text=True)
    finally:
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(stages, ignore_errors=True)  # empty directories once the namespace is gone
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    for line in lines:
        print(line, flush=True)
    if not lines:
        print(json.dumps({"case": "as_ordinary_user", "blocked": False, "as": "user",
                          "evidence": f"{how}; the run as that user gave no result (exit {proc.returncode})"}))
    print(f"attack.py: the second run {how.removeprefix('ran ')}", file=sys.stderr)
    return proc.returncode or (0 if lines else 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--all", action="store_true")
    group.add_argument("--case", help="one case by name, e.g. slowloris_health")
    parser.add_argument("--as", dest="who", choices=["self", "user", "both"], default=None,
                        help="who runs the campaign: this user (self), the ordinary user (user, root only), or "
                             "both in turn (the default as root; self otherwise)")
    args = parser.parse_args()
    who = args.who or ("both" if os.geteuid() == 0 else "self")
    if who != "self" and os.geteuid() != 0:
        print("attack.py: --as user and --as both need root (to create the user and its namespace)", file=sys.stderr)
        return 2
    rest = ["--all"] if args.all else ["--case", args.case]
    if who == "user":
        return _as_ordinary_user([*rest, "--as", "self"])
    status = _campaign(args)
    if who == "both":
        status = max(status, _as_ordinary_user([*rest, "--as", "self"]))
    return status


def _campaign(args: argparse.Namespace) -> int:
    name = pwd.getpwuid(os.geteuid()).pw_name
    cases: list[tuple[str, Callable[[], dict[str, Any]]]] = []
    target: list[Target] = []

    def bind(fn: Callable[[Target], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
        def run() -> dict[str, Any]:
            if not target:
                target.append(Target(host="0.0.0.0", token=os.urandom(16).hex()))
            return fn(target[0])
        return run

    for fn in CASES:
        cases.append((fn.__name__.removeprefix("case_"), bind(fn)))
    try:
        sys.path.insert(0, str(Path(__file__).parent))
        import attack_store  # type: ignore[import-not-found]

        cases += [(getattr(fn, "__name__", "store").removeprefix("case_"), fn) for fn in getattr(attack_store, "CASES", [])]
    except ImportError:
        pass
    if args.case:
        cases = [c for c in cases if c[0] == args.case]
        if not cases:
            print(f"attack.py: no case {args.case!r}", file=sys.stderr)
            return 2
    failed = 0
    try:
        for case, run in cases:
            try:
                result = {"case": case, "as": name, **run()}
            except Exception as e:
                result = {"case": case, "as": name, "blocked": False,
                          "evidence": f"the case failed: {type(e).__name__}: {e}"}
            failed += result["blocked"] is False
            print(json.dumps(result), flush=True)
    finally:
        for t in target:
            t.close()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
