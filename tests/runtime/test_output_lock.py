"""A line written while another thread's write is stuck in the stream's
flush is neither lost nor turned into garbage (``output._write_line``'s
lock rule; CI saw NUL bytes and pointers in a pipe on CPython 3.11.7 and
3.12.1, whose ``TextIOWrapper`` is not safe against that: gh-119506).

The stream is the one Python makes for a redirected ``sys.stdout``: a
``TextIOWrapper`` over a ``BufferedWriter`` over a ``FileIO`` of a pipe. The
pipe is filled first, so thread A's write blocks in the raw write (the GIL
released, inside the wrapper's flush); thread B writes one line then, and
only after that does the pipe drain. Every line must arrive once, intact.
"""
import io
import os
import threading
import time

from jax_effects._runtime import output


def _fill(fd: int) -> int:
  os.set_blocking(fd, False)
  n = 0
  try:
    while True:
      n += os.write(fd, b"f" * 1024)
  except BlockingIOError:
    pass
  os.set_blocking(fd, True)
  return n


def test_a_line_written_during_another_threads_blocked_flush_arrives_intact(
    monkeypatch):
  r, w = os.pipe()
  stream = io.TextIOWrapper(io.BufferedWriter(io.FileIO(w, "w")),
                            encoding="utf-8")
  monkeypatch.setattr("sys.stdout", stream)
  monkeypatch.setattr(output, "_keeps_lines_whole", None)
  monkeypatch.setattr(output, "_needs_lock", None)
  filled = _fill(w)
  n_a = 2000
  progress = [-1]

  def a():
    for i in range(n_a):
      output._write_line(f"a {i:040d}")
      progress[0] = i

  def b():
    output._write_line("b line")

  chunks = []

  def drain():
    while chunk := os.read(r, 1 << 16):
      chunks.append(chunk)

  ta = threading.Thread(target=a)
  ta.start()
  last = None
  while progress[0] != last:     # until A is stuck on the full pipe
    last = progress[0]
    time.sleep(0.2)
  assert progress[0] < n_a - 1, "the pipe never filled: nothing is tested"
  tb = threading.Thread(target=b)
  tb.start()
  tb.join(0.5)                   # B's write lands (or waits for the lock)
  td = threading.Thread(target=drain)
  td.start()
  ta.join(30)
  tb.join(30)
  stream.close()
  td.join(30)
  os.close(r)
  lines = b"".join(chunks)[filled:].split(b"\n")
  assert lines[-1] == b""
  expected = sorted([f"a {i:040d}".encode() for i in range(n_a)]
                    + [b"b line"])
  assert sorted(lines[:-1]) == expected
