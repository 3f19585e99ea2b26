"""Worker process of :class:`jaxrl_async.rewards.pool.WorkerPool` (run as a script, never imported).

Usage: ``python -u _pool_worker.py module:function``.  Protocol (one JSON object per line):
start-up → ``{"ready": true}`` (or ``{"ready": false, "e": ...}`` and exit); then for each request
``{"a": [args], "k": {kwargs}}`` → ``{"ok": true, "v": result}`` or ``{"ok": false, "e": "Type: msg"}``.
The function runs in this process's main thread, so ``signal.alarm``-based timeouts inside it work.
"""
import importlib
import json
import os
import sys


def main() -> None:
    # Running a script puts its own directory first on sys.path; drop it so package modules
    # (e.g. ``pool``, ``sandbox``) cannot shadow top-level modules of the same name.
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)
    out = sys.stdout
    sys.stdout = sys.stderr  # stray prints of the target must not corrupt the protocol
    try:
        mem = int(os.environ.get("JAXRL_POOL_MEMORY_BYTES", "0"))
        if mem > 0:
            import resource
            resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        for mod in filter(None, os.environ.get("JAXRL_POOL_PRELOAD", "").split(",")):
            importlib.import_module(mod)
        module_name, _, func_name = sys.argv[1].partition(":")
        fn = getattr(importlib.import_module(module_name), func_name)
    except BaseException as exc:  # noqa: BLE001
        out.write(json.dumps({"ready": False, "e": f"{type(exc).__name__}: {exc}"}) + "\n")
        out.flush()
        sys.exit(1)
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        try:
            req = json.loads(line)
            reply = {"ok": True, "v": fn(*req.get("a", ()), **req.get("k", {}))}
            text = json.dumps(reply)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller, worker keeps serving
            text = json.dumps({"ok": False, "e": f"{type(exc).__name__}: {exc}"[:2000]})
        out.write(text + "\n")
        out.flush()


if __name__ == "__main__":
    main()
