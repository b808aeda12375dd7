"""A seccomp filter for sandbox runs without a writable cgroup: no System V shared memory, no memfd.

Without a cgroup the server bounds a run's memory by summing what it can see (`MemoryWatch`:
resident memory and the run's tmpfs files). System V shared memory and memfd files that the
run does not keep mapped are not in that sum, and an unprivileged server cannot set the shm
limits of the run's IPC namespace. So there the run may not make either: `shmget` and
`memfd_create` fail with EPERM (POSIX shared memory, files in the run's /dev/shm tmpfs of
`tmpfs_mb`, still works and is counted). Any system call of another ABI than the native one
(x32, i386 through int 0x80) also fails with EPERM. Built for x86_64 and aarch64; elsewhere
`filter_program` returns None and no filter is applied (the docs say so).
"""

from __future__ import annotations

import os
import struct

_ARCHES = {  # machine: (AUDIT_ARCH, shmget, memfd_create, lowest syscall number of a foreign ABI or None)
    "x86_64": (0xC000003E, 29, 319, 0x40000000),
    "aarch64": (0xC00000B7, 194, 279, None),
}
_LD_ABS_W, _JEQ, _JGE, _RET = 0x20, 0x15, 0x35, 0x06
_ALLOW, _DENY = 0x7FFF0000, 0x00050000 | 1  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EPERM


def filter_program(machine: str | None = None) -> bytes | None:
    """The classic BPF program (struct sock_filter[]) bwrap's --seccomp reads; None: no such machine."""
    arch = _ARCHES.get(machine or os.uname().machine)
    if arch is None:
        return None
    audit_arch, shmget, memfd_create, foreign = arch
    ops = [(_LD_ABS_W, 0, 0, 4), (_JEQ, 0, 0xFF, audit_arch), (_LD_ABS_W, 0, 0, 0)]
    if foreign is not None:
        ops.append((_JGE, 0xFF, 0, foreign))
    ops += [(_JEQ, 0xFF, 0, shmget), (_JEQ, 0xFF, 0, memfd_create), (_RET, 0, 0, _ALLOW), (_RET, 0, 0, _DENY)]
    deny = len(ops) - 1
    program = b""
    for i, (code, jt, jf, k) in enumerate(ops):  # 0xFF: jump to the last instruction (deny)
        jt = deny - i - 1 if jt == 0xFF else jt
        jf = deny - i - 1 if jf == 0xFF else jf
        program += struct.pack("=HBBI", code, jt, jf, k)
    return program
