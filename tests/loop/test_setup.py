"""The run's setup (``loop.setup``): a tokenizer without a chat template is used as raw text with a one-line
note, as ``generate`` / ``evaluate`` / ``score`` do (issue 24, Found 5; it used to end the run with a
ValueError traceback after the model load)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_rl_loop import tiny_run_config  # noqa: E402

from jaxrl_async.loop.setup import load_tokenizer_and_data  # noqa: E402


def test_a_tokenizer_without_chat_template_means_raw_prompts_and_a_note(tmp_path, capsys):
    from jaxrl_async.testing import make_tiny_hf_model, make_tiny_tokenizer

    hf = make_tiny_hf_model(str(tmp_path / "hf"), "qwen3", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128)
    make_tiny_tokenizer(hf)
    cfg = tiny_run_config(tmp_path / "run", **{"model.path": hf})
    assert cfg.data.apply_chat_template
    tok, _, train_ds, eval_records = load_tokenizer_and_data(cfg, str(tmp_path / "run"), lambda s: None)
    assert getattr(tok, "chat_template", None) is None
    err = capsys.readouterr().err
    assert f"main: note: the tokenizer in {hf} has no chat template; prompts are used as raw text" in err
    r = train_ds.records[0]
    assert list(r.prompt_ids) == tok.encode(r.prompt, add_special_tokens=False) and len(eval_records) == 8
