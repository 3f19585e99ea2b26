"""`config/machine.py`: the machine's layout for `mesh.layout=auto` and for accelerator layouts on a CPU (issue 31)."""

from __future__ import annotations

import glob
import os

import pytest

from jaxrl_async.config import ConfigError, RunConfig, load_config_file, validate
from jaxrl_async.config.machine import cpu_devices_before_start, fit_to_machine
from jaxrl_async.config.sections import MeshConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_every_published_config_fits_a_cpu(path):
    cfg = load_config_file(path)
    fitted, lines = fit_to_machine(cfg, "cpu", 2, cores=2)
    if cfg.mesh.layout is None:  # CPU configs already: untouched
        assert fitted is cfg and lines == []
        return
    validate(fitted, 2)  # the two simulated devices the run starts with
    assert fitted.model.dtype == "float32" and fitted.mesh.layout is None and fitted.mesh.cpu_devices == 2
    assert fitted.rollout.engine.num_pages is None
    assert fitted.trainer.packing.tokens_per_micro <= max(fitted.trainer.packing.row_len_buckets)
    # the algorithm is the recipe's
    for keep in ("batch_size", "lr", "loss", "advantage", "ppo_n_minibatches", "total_steps"):
        assert getattr(fitted.trainer, keep) == getattr(cfg.trainer, keep), keep
    assert (fitted.rollout.n_samples, fitted.rollout.sampling, fitted.data) == (
        cfg.rollout.n_samples, cfg.rollout.sampling, cfg.data)
    assert lines[0].startswith(f"mesh.layout={cfg.mesh.layout} is sized for ") and len(lines) == len(set(lines))
    assert any(ln.startswith(f"model.dtype={cfg.model.dtype} -> float32: ") for ln in lines) == (
        cfg.model.dtype != "float32")
    assert cpu_devices_before_start(cfg) == 2


def test_auto_on_accelerators_and_named_layouts_on_their_hardware():
    cfg = load_config_file(os.path.join(ROOT, "configs", "qwen3_0_6b.py"))  # h100x8, 192 slots
    assert fit_to_machine(cfg, "gpu", 8) == (cfg, [])  # the layout's hardware: validation checks the count
    assert fit_to_machine(cfg, "gpu", 4)[0] is cfg  # another GPU count: the layout's error stays (validation)
    auto = cfg.__class__(**{**cfg.__dict__, "mesh": MeshConfig(layout="auto")})
    one, lines = fit_to_machine(auto, "gpu", 1)
    assert one.mesh.colocate and "time-share" in lines[0]
    validate(one, 1)
    eight, lines = fit_to_machine(auto, "gpu", 8)
    assert eight.mesh.num_generator_devices == 6 and eight.mesh.generator.shape == (6, 1)
    assert eight.mesh.trainer.shape == (2,) and eight.model.dtype == cfg.model.dtype  # bf16 kept on GPUs
    validate(eight, 8)
    five, _ = fit_to_machine(auto, "tpu", 5)  # round(0.75 x 5) = 4 replicas, and 192 slots split over them
    assert 192 % five.mesh.num_generator_devices == 0


def test_auto_left_unresolved_is_one_error_naming_the_field():
    with pytest.raises(ConfigError, match=r"mesh\.layout.*'auto' is resolved when a run starts"):
        validate(RunConfig(mesh=MeshConfig(layout="auto")), 2)
