"""Running test code on other Python threads (each has its own token state)."""
import threading

JOIN_TIMEOUT_S = 900


def in_thread(fn, *args):
  """Runs ``fn(*args)`` in a fresh thread; returns its result or raises."""
  box = {}

  def target():
    try:
      box["out"] = fn(*args)
    except BaseException as e:  # noqa: BLE001 - re-raised below
      box["err"] = e

  t = threading.Thread(target=target)
  t.start()
  t.join()
  if "err" in box:
    raise box["err"]
  return box["out"]


def run_threads(targets, *, start_together=True):
  """Runs each target in its own thread (released together by default).

  Fails if a thread hangs; re-raises the first exception a target raised.
  """
  errors = []
  go = threading.Event()

  def wrap(fn):
    def run():
      if start_together:
        go.wait()
      try:
        fn()
      except BaseException as exc:  # noqa: BLE001 - re-raised below
        errors.append(exc)
    return run

  threads = [threading.Thread(target=wrap(t)) for t in targets]
  for t in threads:
    t.start()
  go.set()
  for t in threads:
    t.join(JOIN_TIMEOUT_S)
  assert not any(t.is_alive() for t in threads), "a worker thread hangs"
  if errors:
    raise errors[0]
