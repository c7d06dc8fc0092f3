#!/usr/bin/env python3
"""Mooncake Transfer Engine TCP benchmark: wall time of one transfer_sync_write
(or transfer_sync_read) of N bytes between two registered host buffers in two
processes, using protocol "tcp" and metadata "P2PHANDSHAKE" (no etcd).

For each size in --bytes: 1 untimed warm-up plus --reps timed transfers, then
the sender reads the receiver's buffer back with transfer_sync_read and compares
SHA-256 (each size uses its own byte pattern, so stale data cannot pass). In
--role both the receiver's own SHA-256 of its buffer is checked too.
stdout: one JSON line per size {"bytes", "seconds", "mooncake_version"}.
Errors go to stderr with a nonzero exit; --deadline (s) kills a hung run.

Roles:
  both      (default) spawns `--role receiver` as a child process, runs sender.
  receiver  registers --capacity bytes (default: max of --bytes), prints
            `ready <session_id> <buffer_addr_hex> <capacity>` to stdout, then
            serves until stdin closes; stdin line `sum N` -> `sum N <sha256>`.
  sender    --peer is the receiver's session id (ip:port from the ready line).

  python scripts/mooncake_transfer.py --bytes 5898240,23592960 --reps 5
  ip netns exec B python scripts/mooncake_transfer.py --role receiver \
      --local-host 10.99.0.2 --bytes 188743680      # -> ready 10.99.0.2:PORT ...
  ip netns exec A python scripts/mooncake_transfer.py --role sender \
      --local-host 10.99.0.1 --peer 10.99.0.2:PORT --bytes 188743680 --reps 5
"""
import argparse
import ctypes
import faulthandler
import hashlib
import importlib.metadata as md
import json
import mmap
import os
import random
import subprocess
import sys
import time

DEFAULT_BYTES = ",".join(str(46080 * t) for t in (128, 512, 1024, 2048, 4096))


def die(msg):
    print(f"mooncake_transfer: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def version():
    dists = md.packages_distributions().get("mooncake") or []
    return md.version(dists[0]) if dists else "unknown"


def protect_stdout():
    """Return a writer on the real stdout and point fd 1 at stderr, so that
    anything the C++ library prints cannot corrupt our protocol/JSON lines."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout.flush()
    os.dup2(2, 1)
    return out


def host_buffer(n):
    m = mmap.mmap(-1, max(n, 1))
    return m, ctypes.addressof(ctypes.c_char.from_buffer(m))


def engine(local_host, buf_addr, n):
    from mooncake.engine import TransferEngine
    te = TransferEngine()
    if te.initialize(local_host, "P2PHANDSHAKE", "tcp", "") != 0:
        die(f"TransferEngine.initialize({local_host!r}, P2PHANDSHAKE, tcp) failed")
    if te.register_memory(buf_addr, n, "cpu:0") != 0:
        die(f"register_memory({n} bytes) failed")
    return te


def fill(m, n):
    """Size-specific pattern: a 1 MiB pseudo-random block seeded by n, tiled."""
    block = random.Random(n).randbytes(1 << 20)
    for off in range(0, n, len(block)):
        k = min(len(block), n - off)
        m[off:off + k] = block[:k]


def sha(m, n):
    return hashlib.sha256(memoryview(m)[:n]).hexdigest()


def run_receiver(a, sizes):
    out = protect_stdout()
    cap = a.capacity or max(sizes)
    m, addr = host_buffer(cap)
    te = engine(a.local_host, addr, cap)
    out.write(f"ready {a.local_host}:{te.get_rpc_port()} {addr:#x} {cap}\n")
    for line in sys.stdin:  # serve until stdin closes (or we are killed)
        parts = line.split()
        if len(parts) == 2 and parts[0] == "sum" and parts[1].isdigit() and int(parts[1]) <= cap:
            out.write(f"sum {parts[1]} {sha(m, int(parts[1]))}\n")
        elif parts:
            print(f"receiver: ignoring {line.strip()!r}", file=sys.stderr)
    te.unregister_memory(addr)


def run_sender(a, sizes, peer, ask_sum=None):
    out = protect_stdout()
    cap = max(sizes)
    m, addr = host_buffer(cap)
    vm, vaddr = host_buffer(cap)
    te = engine(a.local_host, addr, cap)
    if te.register_memory(vaddr, cap, "cpu:0") != 0:
        die("register_memory(verify buffer) failed")
    remote = a.remote_addr or te.get_first_buffer_address(peer)
    if not remote:
        die(f"no registered buffer found at peer {peer!r}")
    ver = version()
    for n in sizes:
        fill(m, n)
        if a.op == "read":  # put the pattern remote first, then time reads
            if te.transfer_sync_write(peer, addr, remote, n) != 0:
                die(f"transfer_sync_write to {peer} of {n} bytes failed")
        xfer = te.transfer_sync_write if a.op == "write" else te.transfer_sync_read
        local = addr if a.op == "write" else vaddr
        secs = []
        for rep in range(a.reps + 1):
            t0 = time.perf_counter()
            rc = xfer(peer, local, remote, n)
            dt = time.perf_counter() - t0
            if rc != 0:
                die(f"transfer_sync_{a.op} with {peer} of {n} bytes: rc={rc}")
            if rep:  # rep 0 is the warm-up
                secs.append(dt)
        if te.transfer_sync_read(peer, vaddr, remote, n) != 0:
            die(f"verification read-back of {n} bytes failed")
        want = sha(m, n)
        if sha(vm, n) != want:
            die(f"{n} bytes: data read back from receiver does not match")
        if ask_sum and ask_sum(n) != want:
            die(f"{n} bytes: receiver's own checksum does not match")
        out.write(json.dumps({"bytes": n, "seconds": secs, "mooncake_version": ver}) + "\n")
    te.unregister_memory(vaddr)
    te.unregister_memory(addr)


def run_both(a, sizes):
    cmd = [sys.executable, os.path.abspath(__file__), "--role", "receiver",
           "--local-host", a.peer or "127.0.0.1", "--capacity", str(max(sizes)),
           "--deadline", str(a.deadline), "--bytes", a.bytes]
    rx = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ready = rx.stdout.readline().split()
        if len(ready) != 4 or ready[0] != "ready":
            die(f"receiver did not become ready (exit {rx.poll()}, got {ready})")

        def ask_sum(n):
            rx.stdin.write(f"sum {n}\n")
            rx.stdin.flush()
            reply = rx.stdout.readline().split()
            return reply[2] if len(reply) == 3 and reply[0] == "sum" else None

        a.remote_addr = int(ready[2], 16)
        run_sender(a, sizes, ready[1], ask_sum)
    finally:
        try:
            rx.stdin.close()
            rx.wait(timeout=10)
        except Exception:
            rx.kill()
    if rx.returncode not in (0, None):
        die(f"receiver exited with {rx.returncode}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", choices=["both", "receiver", "sender"], default="both")
    p.add_argument("--local-host", default="127.0.0.1", help="this side's IP")
    p.add_argument("--peer", help="both: receiver IP (default 127.0.0.1); "
                   "sender: receiver session id ip:port")
    p.add_argument("--bytes", default=DEFAULT_BYTES, help="comma separated sizes")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--op", choices=["write", "read"], default="write")
    p.add_argument("--capacity", type=int, default=0, help="receiver buffer size")
    p.add_argument("--remote-addr", type=lambda s: int(s, 0), default=0,
                   help="sender: receiver buffer address (default: ask the peer)")
    p.add_argument("--deadline", type=float, default=120.0, help="0 disables")
    a = p.parse_args()
    try:
        sizes = [int(s) for s in a.bytes.split(",") if s.strip()]
    except ValueError:
        die(f"bad --bytes {a.bytes!r}")
    if not sizes or min(sizes) <= 0 or a.reps < 1:
        die("need positive --bytes and --reps >= 1")
    if a.deadline > 0:  # C-level timer: fires even while blocked inside C++
        faulthandler.dump_traceback_later(a.deadline, exit=True)
    if a.role == "receiver":
        run_receiver(a, sizes)
    elif a.role == "sender":
        if not a.peer or ":" not in a.peer:
            die("--role sender needs --peer <receiver ip:port>")
        run_sender(a, sizes, a.peer)
    else:
        run_both(a, sizes)


if __name__ == "__main__":
    main()
