"""The standard-library progress bar: tqdm's meter, drawn without tqdm.

Without tqdm (``_runtime/bars.py``) :class:`PlainBar` draws what tqdm
draws: :func:`format_meter` is tqdm 4.x's ``tqdm.format_meter`` written
again, field for field, for the options drawn here (:data:`DRAWN`); the
other tqdm options (:data:`OPTIONS`) are accepted and change nothing (the
rate is the average since the bar opened, as ``smoothing=0``; bars stack in
the order they draw). Drawing follows tqdm (``delay``, ``miniters``,
``mininterval``, ``leave``, ``disable``): in place (``\\r``) on a terminal,
a line per drawing elsewhere. A bar's line on a terminal is *live* until it
ends; :func:`around_write` writes around the live lines, as
``tqdm.write`` does.

No part of the token calling convention: these run inside host callbacks
(``BarSpec``'s), which the convention has already put in order.
"""
from __future__ import annotations

from collections.abc import Mapping
import datetime
from numbers import Number
import sys
import threading
import time
from typing import Any, Callable, TextIO

from jax_effects._runtime import fork as _fork

#: tqdm's keyword arguments (tqdm 4.x) besides ``total``, ``desc`` and
#: ``file`` (``progress``'s own): the options a bar takes, whichever renderer
#: draws it.
OPTIONS = frozenset({
    "iterable", "leave", "ncols", "mininterval", "maxinterval", "miniters",
    "ascii", "disable", "unit", "unit_scale", "dynamic_ncols", "smoothing",
    "bar_format", "initial", "position", "postfix", "unit_divisor",
    "write_bytes", "lock_args", "nrows", "colour", "delay", "gui"})

#: The options the standard-library renderer draws as tqdm does.
DRAWN = ("leave", "disable", "mininterval", "miniters", "delay", "unit",
         "unit_scale", "unit_divisor", "ncols", "ascii", "initial", "postfix",
         "bar_format")

_ASCII = " 123456789#"
_UTF = " " + "".join(map(chr, range(0x258F, 0x2587, -1)))
_PLAIN = " #"


def _interval(seconds: float) -> str:
  """``mm:ss`` or ``h:mm:ss`` (``tqdm.format_interval``)."""
  sign = "-" if seconds < 0 else ""
  minutes, s = divmod(abs(int(seconds)), 60)
  h, m = divmod(minutes, 60)
  return f"{sign}{h:d}:{m:02d}:{s:02d}" if h else f"{sign}{m:02d}:{s:02d}"


def _sizeof(num: float, divisor: float = 1000) -> str:
  """``tqdm.format_sizeof``: 3 significant digits and an SI prefix."""
  for unit in ("", "k", "M", "G", "T", "P", "E", "Z"):
    if abs(num) < 999.5:
      if abs(num) < 99.95:
        if abs(num) < 9.995:
          return f"{num:1.2f}{unit}"
        return f"{num:2.1f}{unit}"
      return f"{num:3.0f}{unit}"
    num /= divisor
  return f"{num:3.1f}Y"


def _format_num(n) -> str:
  """A value of a ``postfix`` mapping as ``set_postfix`` writes it: a
  number as ``tqdm.format_num``, anything else as ``str``."""
  if not isinstance(n, Number):
    return str(n)
  f = f"{n:.3g}".replace("e+0", "e+").replace("e-0", "e-")
  n = str(n)
  return f if len(f) < len(n) else n


def format_postfix(postfix) -> str | None:
  """The text of a ``postfix=`` option as tqdm makes it (``set_postfix``
  for a mapping: keys sorted, numbers shortened; else as given)."""
  if not isinstance(postfix, Mapping) or not postfix:
    return postfix
  return ", ".join(f"{key}={_format_num(postfix[key]).strip()}"
                   for key in sorted(postfix))


class _Probe:
  """The ``{bar}`` field while the rest is measured (tqdm's
  ``FormatReplace``): empty, whatever its spec."""
  called = False

  def __format__(self, spec: str) -> str:
    self.called = True
    return ""


class _Bar:
  """The ``{bar}`` field (tqdm's ``Bar``): ``frac`` of ``length`` cells."""

  def __init__(self, frac: float, length: int, charset: str):
    self.frac = frac if frac <= 1 else 1
    self.length = length
    self.charset = charset

  def __format__(self, spec: str) -> str:
    charset, length = self.charset, self.length
    if spec:
      kind = spec[-1].lower()
      if kind in "aub":
        charset = {"a": _ASCII, "u": _UTF, "b": "  "}[kind]
        spec = spec[:-1]
      if spec:
        length = int(spec) + (self.length if int(spec) < 0 else 0)
    steps = len(charset) - 1
    full, part = divmod(int(self.frac * length * steps), steps)
    text = charset[-1] * full
    if full < length:
      text += charset[part] + charset[0] * (length - full - 1)
    return text


def format_meter(n: float, total: float | None, elapsed: float, *,
                 ncols: int | None = None, prefix: str = "",
                 ascii: bool | str | None = None, unit: str = "it",
                 unit_scale: bool | float = False, bar_format: str | None = None,
                 postfix: str | None = None, unit_divisor: float = 1000,
                 initial: float = 0) -> str:
  """The text of a bar, as ``tqdm.format_meter`` writes it (``ascii=None``
  draws ``" #"``)."""
  if total and n >= total + 0.5:
    total = None
  if unit_scale and unit_scale not in (True, 1):
    if total:
      total *= unit_scale
    n *= unit_scale
    unit_scale = False
  elapsed_str = _interval(elapsed)
  rate = (n - initial) / elapsed if elapsed else None
  inv_rate = 1 / rate if rate else None
  rate_noinv_fmt = ((_sizeof(rate) if unit_scale else f"{rate:5.2f}")
                    if rate else "?") + unit + "/s"
  rate_inv_fmt = ((_sizeof(inv_rate) if unit_scale else f"{inv_rate:5.2f}")
                  if inv_rate else "?") + "s/" + unit
  rate_fmt = rate_inv_fmt if inv_rate and inv_rate > 1 else rate_noinv_fmt
  n_fmt = _sizeof(n, unit_divisor) if unit_scale else str(n)
  total_fmt = ("?" if total is None else _sizeof(total, unit_divisor)
               if unit_scale else str(total))
  postfix = ", " + postfix if postfix else ""
  remaining = (total - n) / rate if rate and total else 0
  remaining_str = _interval(remaining) if rate else "?"
  try:
    eta = (datetime.datetime.now() + datetime.timedelta(seconds=remaining)
           if rate and total
           else datetime.datetime.fromtimestamp(0, datetime.timezone.utc))
  except OverflowError:
    eta = datetime.datetime.max
  l_bar = (prefix if prefix[-2:] == ": " else prefix + ": ") if prefix else ""
  r_bar = (f"| {n_fmt}/{total_fmt} [{elapsed_str}<{remaining_str}, "
           f"{rate_fmt}{postfix}]")
  fields = {
      "n": n, "n_fmt": n_fmt, "total": total, "total_fmt": total_fmt,
      "elapsed": elapsed_str, "elapsed_s": elapsed, "ncols": ncols,
      "desc": prefix or "", "unit": unit,
      "rate": inv_rate if inv_rate and inv_rate > 1 else rate,
      "rate_fmt": rate_fmt, "rate_noinv": rate,
      "rate_noinv_fmt": rate_noinv_fmt, "rate_inv": inv_rate,
      "rate_inv_fmt": rate_inv_fmt, "postfix": postfix,
      "unit_divisor": unit_divisor, "colour": None,
      "remaining": remaining_str, "remaining_s": remaining,
      "l_bar": l_bar, "r_bar": r_bar, "eta": eta, "nrows": None}
  charset = (_PLAIN if ascii is None else _ASCII if ascii is True
             else _UTF if ascii is False else ascii)
  if total:
    frac = n / total
    percentage = frac * 100
    l_bar += f"{percentage:3.0f}%|"
    if ncols == 0:
      return l_bar[:-1] + r_bar[1:]
    fields["l_bar"] = l_bar
    if bar_format:
      fields["percentage"] = percentage
      if not prefix:
        bar_format = bar_format.replace("{desc}: ", "")
    else:
      bar_format = "{l_bar}{bar}{r_bar}"
  elif bar_format:
    l_bar += "|"
    fields.update(l_bar=l_bar, percentage=0)
    frac, charset = 0, "  "
  else:
    text = (f"{(prefix + ': ') if prefix else ''}{n_fmt}{unit} "
            f"[{elapsed_str}, {rate_fmt}{postfix}]")
    return text[:ncols] if ncols else text
  probe = _Probe()
  text = bar_format.format(bar=probe, **fields)
  if probe.called:   # (the bar fills what the rest leaves of ncols)
    bar = _Bar(frac, max(1, ncols - len(text)) if ncols else 10, charset)
    text = bar_format.format(bar=bar, **fields)
  return text[:ncols] if ncols else text


# --- drawing ---------------------------------------------------------------

#: Serializes drawing and the writes around live lines (reentrant: a log
#: handler run inside :func:`around_write` may print).
lock = threading.RLock()
# id(stream) -> the PlainBar whose line is live on that terminal.
_live: dict[int, "PlainBar"] = {}
_open = 0   # plain bars open (for leave=None)


@_fork.reset_in_child
def _reset_after_fork() -> None:
  global lock, _open
  lock = threading.RLock()
  _live.clear()
  _open = 0


def _same_terminal(a, b) -> bool:
  """Whether writes to ``a`` and ``b`` land on one screen: the same stream,
  or the process's stdout and stderr (``None``: either of them)."""
  std = (sys.stdout, sys.stderr, None)
  return a is b or (a in std and b in std)


def around_write(stream: TextIO | None, write: Callable[[], Any]) -> None:
  """Runs ``write()`` (to ``stream``; None: stdout or stderr) with the live
  bar lines on that terminal cleared before and redrawn after."""
  with lock:
    cleared = [b for b in _live.values() if _same_terminal(b.stream, stream)]
    for b in cleared:
      b.clear()
    try:
      write()
    finally:
      for b in cleared:
        b.redraw()


class PlainBar:
  """A bar drawn with the standard library. ``on_live(bool)`` is called
  (under :data:`lock`) when the first line goes live and the last ends."""

  def __init__(self, total: int | None, desc: str | None,
               file: TextIO | None, options: dict,
               on_live: Callable[[bool], None]):
    o = options
    self.total = total
    self.file = file
    self.on_live = on_live
    self.leave = o.get("leave", True)
    self.disable = o.get("disable", False)
    self.mininterval = float(o.get("mininterval", 0.1))
    self.miniters = o.get("miniters") or 0
    self.delay = float(o.get("delay", 0))
    self.n = self.initial = o.get("initial", 0)
    self.meter = dict(
        ncols=o.get("ncols"), ascii=o.get("ascii"), unit=o.get("unit", "it"),
        unit_scale=o.get("unit_scale", False), bar_format=o.get("bar_format"),
        prefix=desc or "", postfix=format_postfix(o.get("postfix")),
        unit_divisor=o.get("unit_divisor", 1000), initial=self.initial)
    self.stream: TextIO | None = None
    self.tty = False
    self.drawn_n = None      # the count last drawn (None: never drawn)
    self.width = 0           # the length of the live line's text
    self.start = self.last = 0.0

  def open(self) -> None:
    global _open
    stream = self.stream = self.file if self.file is not None else sys.stderr
    try:
      self.tty = bool(stream.isatty())
    except (AttributeError, ValueError):
      self.tty = False
    if self.disable is None:
      self.disable = not self.tty
    with lock:
      if self.leave is None:
        self.leave = _open == 0
      _open += 1
    self.start = self.last = time.monotonic()
    if self.delay <= 0:
      self._draw(self.start, end=False)

  def advance(self, n: int) -> None:
    self.n += n
    if self.n - (self.drawn_n or 0) < self.miniters:
      return
    now = time.monotonic()
    if now - self.last >= self.mininterval and now >= self.start + self.delay:
      self.last = now
      self._draw(now, end=False)

  def close(self, n: int) -> None:
    global _open
    self.n += n
    with lock:
      _open -= 1
      if self.drawn_n is None:   # never drawn (delay): nothing to leave
        return
      if self.leave:
        self._draw(time.monotonic(), end=True)
      elif _live.get(id(self.stream)) is self:
        self.clear()
        self._end_live()

  def _write(self, text: str) -> None:
    self.stream.write(text)
    self.stream.flush()

  def _end_live(self) -> None:
    _live.pop(id(self.stream), None)
    if not _live:
      self.on_live(False)

  def clear(self) -> None:
    """Erases the live line (tqdm's ``clear``)."""
    self._write("\r" + " " * self.width + "\r")

  def redraw(self) -> None:
    """Draws the live line again, with the current count."""
    self._draw(time.monotonic(), end=False)

  def _draw(self, now: float, end: bool) -> None:
    if self.disable or self.stream is None:
      return
    with lock:
      shown = self.drawn_n == self.n   # (the last drawing shows the count)
      if end and shown and not self.tty:
        return
      self.drawn_n = self.n
      text = format_meter(self.n, self.total, now - self.start, **self.meter)
      if not self.tty:
        self._write(text + "\n")
        return
      last = _live.get(id(self.stream))
      if end:
        if last is self:
          self._end_live()
          if shown:   # the line is current: end it
            self._write("\n")
            return
      else:
        if not _live:
          self.on_live(True)
        _live[id(self.stream)] = self
      # (after another bar's line, this one starts a line of its own)
      lead = "\r" if last is self or last is None else "\n"
      pad = " " * (self.width - len(text)) if last is self else ""
      self.width = 0 if end else len(text)
      self._write(lead + text + pad + ("\n" if end else ""))
