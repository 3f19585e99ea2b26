"""Weights & Biases logging (``logging.wandb``, ``loop/wandb_logger.py``), without network: a real tiny run in
offline mode writes every scalar of ``metrics.jsonl`` to its W&B run at the same step, with the resolved config,
under the run directory, and a resume continues the same W&B run id; a missing ``wandb`` package is a one-line
config error at validation; a W&B run that cannot start (online without credentials) is a one-line config error
before anything is compiled. The W&B run files (``run-<id>.wandb``: W&B's record log of protobuf ``Record``s)
are read back with ``wandb_records``."""
from __future__ import annotations

import glob
import json
import os
import struct
import sys
import time

import pytest

from jaxrl_async.config import ConfigError, apply_overrides, validate
from jaxrl_async.loop import RLRun
from test_rl_loop import _rows, tiny_run_config

pytest.importorskip("wandb")


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """W&B kept off the network and out of the home directory: no credentials, a server address nothing listens
    on, its config/cache/data directories under tmp_path, quiet."""
    home = tmp_path / "wandb_home"
    for var in ("WANDB_API_KEY", "WANDB_ENTITY", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_MODE",
                "WANDB_DIR", "WANDB_NAME", "WANDB_TAGS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(home))  # no ~/.netrc credentials
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    for var, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data"),
                     ("WANDB_ARTIFACT_DIR", "artifacts")):
        monkeypatch.setenv(var, str(home / sub))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("WANDB_DISABLE_CODE", "true")
    return home


def wandb_records(path: str) -> list:
    """The protobuf ``Record``s of a ``run-<id>.wandb`` file: a header (``:W&B``, magic 0xBEE1, version 0), then
    LevelDB-log framing in 32 KiB blocks (7-byte chunk headers: crc32, length, type FULL=1 / FIRST=2 / MIDDLE=3 /
    LAST=4; a block tail under 7 bytes is padding)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    block, pos, chunks, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and n == 0:  # zero fill: the end of what was written
            break
        chunks += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(chunks)
            out.append(rec)
            chunks = b""
    return out


def _finished_records(path: str, timeout_s: float = 30.0) -> list:
    """The records of a finished run's file: ``finish()`` returns before W&B's service process has written all of
    it (seen: an empty file), so wait for the ``exit`` record."""
    t0 = time.monotonic()
    while True:
        recs = wandb_records(path) if os.path.exists(path) else []
        if any(r.WhichOneof("record_type") == "exit" for r in recs) or time.monotonic() - t0 > timeout_s:
            return recs
        time.sleep(0.1)


def offline_run(run_dir, run_id: str) -> list[dict]:
    """The W&B runs of the ``RUN/wandb/offline-run-*-<id>`` directories (one per process, oldest first): run
    record (id, project, name, tags, config) and history ({step: {key: value}})."""
    out = []
    for d in sorted(glob.glob(os.path.join(run_dir, "wandb", f"offline-run-*-{run_id}"))):
        recs = _finished_records(os.path.join(d, f"run-{run_id}.wandb"))
        (run,) = [r.run for r in recs if r.WhichOneof("record_type") == "run"]
        history: dict[int, dict] = {}
        for r in recs:
            if r.WhichOneof("record_type") == "history":
                items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
                history.setdefault(r.history.step.num, {}).update(
                    {k: v for k, v in items.items() if not k.startswith("_")})
        out.append({"dir": d, "id": run.run_id, "project": run.project, "name": run.display_name, "tags": list(run.tags),
                    "config": {i.key: json.loads(i.value_json) for i in run.config.update}, "history": history})
    return out


def _logged(run_dir) -> dict[int, dict]:
    """metrics.jsonl as W&B should hold it: the scalars of every row, merged per step."""
    from jaxrl_async.loop.wandb_logger import wandb_scalars

    out: dict[int, dict] = {}
    for row in _rows(run_dir):
        out.setdefault(row["step"], {}).update(wandb_scalars(row))
    return out


def _same(wb: dict, logged: dict) -> None:
    assert set(wb) == set(logged), (sorted(set(wb) ^ set(logged)))
    for k, v in logged.items():
        assert wb[k] == pytest.approx(v, rel=1e-6), k


def test_offline_run_logs_every_scalar_with_the_config_and_a_resume_continues_the_run(tmp_path, wandb_env):
    over = {"logging.wandb": "true", "logging.wandb_mode": "offline", "logging.wandb_tags": "tiny,ci",
            "logging.tensorboard": "true"}
    cfg = tiny_run_config(tmp_path / "run", steps=2, **over)
    res = RLRun(cfg).run()
    assert res.stopped_by == "completed" and res.steps == 2
    run_id = open(os.path.join(res.run_dir, "wandb_id")).read().strip()
    (first,) = offline_run(res.run_dir, run_id)
    assert (first["id"], first["project"], first["name"], first["tags"]) == (run_id, "t", "run", ["tiny", "ci"])
    # the resolved config: config.json's sections and its _resolved part (as "resolved")
    saved = json.load(open(os.path.join(res.run_dir, "config.json")))
    assert first["config"]["trainer"] == saved["trainer"] and first["config"]["logging"]["wandb"] is True
    assert first["config"]["resolved"] == saved["_resolved"]
    logged = _logged(res.run_dir)
    assert sorted(first["history"]) == sorted(logged) == [1, 2]
    for step in (1, 2):
        _same(first["history"][step], logged[step])
    assert "reward/mean" in first["history"][2] and "train/loss" in first["history"][2]

    # resume: the same W&B run id, a second offline-run directory from the checkpoint's step on
    res2 = RLRun(tiny_run_config(tmp_path / "run", steps=3, **over)).run()
    assert res2.steps == 3
    assert open(os.path.join(res.run_dir, "wandb_id")).read().strip() == run_id
    runs = offline_run(res.run_dir, run_id)
    assert len(runs) == 2 and runs[1]["id"] == run_id
    logged = _logged(res.run_dir)
    second = runs[1]["history"]
    assert sorted(second) == [2, 3]  # the resume's row at the checkpoint's step, then step 3
    assert second[2]["resume/checkpoint_step"] == 2 and "train/loss" not in second[2]
    _same(second[3], logged[3])


def test_missing_wandb_package_is_one_config_line_at_validation(tmp_path, monkeypatch, capsys):
    from jaxrl_async.cli.main import main
    from jaxrl_async.config.default import get_config

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError, as when not installed
    cfg = apply_overrides(get_config(), [f"run_dir={tmp_path / 'run'}", "logging.wandb=true"])
    with pytest.raises(ConfigError) as e:
        validate(cfg, num_devices=1)
    assert e.value.field == "logging.wandb" and "\n" not in str(e.value)
    assert "pip install 'jaxrl_async[wandb]'" in str(e.value)
    validate(apply_overrides(cfg, ["logging.wandb=false"]), num_devices=1)  # off: wandb is not needed
    # the command line: one line, exit 2, nothing built
    assert main([f"run_dir={tmp_path / 'run'}", "logging.wandb=true", "--dry-run"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("main: config error: logging.wandb: needs the wandb package"), err
    assert not os.path.exists(tmp_path / "run")


@pytest.mark.parametrize("overrides, field", [
    (["logging.wandb_project=a/b"], "logging.wandb_project"),
    (["logging.wandb_entity="], "logging.wandb_entity"),
    (["logging.wandb_run_name= "], "logging.wandb_run_name"),
    (["name=a:b", "logging.wandb=true"], "logging.wandb_project"),
])
def test_wandb_names_are_checked_at_validation(tmp_path, overrides, field):
    from jaxrl_async.config.default import get_config

    cfg = apply_overrides(get_config(), [f"run_dir={tmp_path / 'run'}", *overrides])
    with pytest.raises(ConfigError) as e:
        validate(cfg, num_devices=1)
    assert e.value.field == field and "\n" not in str(e.value), str(e.value)


def test_a_wandb_run_that_cannot_start_stops_the_run_in_one_line_before_compiling(tmp_path, wandb_env):
    """Online without credentials: ``RLRun.run`` raises one ``ConfigError`` naming ``logging.wandb`` before the
    trainer is built (nothing compiled); the id for the next try is kept."""
    cfg = tiny_run_config(tmp_path / "run", steps=1, **{"logging.wandb": "true"})
    loop = RLRun(cfg)
    with pytest.raises(ConfigError) as e:
        loop.run()
    msg = str(e.value)
    assert e.value.field == "logging.wandb" and "\n" not in msg, msg
    assert "did not start" in msg and "API key" in msg and "logging.wandb_mode=offline" in msg, msg
    assert loop.trainer is None  # the trainer was never built
    assert os.path.isfile(os.path.join(loop.run_dir, "wandb_id"))
