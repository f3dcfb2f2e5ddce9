"""The blockwise grouped GEMM benchmark's CPU side: the expert GEMMs it
times per config, and a clear exit where the kernel cannot run."""

from transformer_engine_compile.benchmarks import grouped_gemm as gg
from transformer_engine_compile.benchmarks.moe import CONFIGS


def test_the_expert_gemms_of_a_config():
    up, down = gg.shapes("mixtral")
    assert (up.groups, up.rows, up.k, up.n) == (8, 16384 * 2, 4096, 2 * 14336)
    assert (down.groups, down.rows, down.k, down.n) == (8, 16384 * 2, 14336, 4096)
    assert up.flops == 2 * 32768 * 4096 * 28672


def test_every_config_routes_whole_tiles_per_expert():
    for name in CONFIGS:
        if name != "tiny":
            for s in gg.shapes(name):
                assert (s.rows // s.groups) % gg.TILE == 0 and s.k % gg.TILE == 0, s


def test_without_the_kernel_it_says_why(capsys):
    assert gg.main(["--configs", "mixtral"]) == 0
    assert "cannot run here" in capsys.readouterr().out


def test_the_dense_gemms_of_a_llama_config():
    """--dense: te.Linear's projections of a benchmarks.llama config, each a
    whole number of 128-tiles (the kernel's tile), the LM head with a
    Hugging Face config's vocabulary."""
    shapes = {s.name.split()[-1]: s for s in gg.dense_shapes("hf-llama-b")}
    assert list(shapes) == ["q/o", "k/v", "gate/up", "down", "lm_head"]
    assert (shapes["k/v"].rows, shapes["k/v"].k, shapes["k/v"].n) == (8192, 4096, 1024)
    assert (shapes["down"].k, shapes["down"].n) == (14336, 4096)
    assert shapes["lm_head"].n == 32000
    assert [s.name for s in gg.dense_shapes("llama-a")][-1] == "llama-a down"  # no LM head
    for config in ("llama-a", "llama-b", "hf-llama-a", "hf-llama-b"):
        for s in gg.dense_shapes(config):
            assert s.groups == 1 and s.rows % gg.TILE == s.k % gg.TILE == s.n % gg.TILE == 0, s


def test_dense_refuses_an_unknown_config(capsys):
    import pytest

    with pytest.raises(SystemExit):
        gg.main(["--dense", "llama-z"])
    assert "unknown configs ['llama-z']" in capsys.readouterr().err


def test_tokens_override_the_configs_own():
    """--tokens: the same experts at another token count per step, named so
    that rows of two counts do not collide; a count the experts cannot take
    in whole 128-tiles each is refused before any GPU work."""
    import pytest

    up, down = gg.shapes("deepseek", 32768)
    assert up.name == "deepseek@32768 gate_up" and up.rows == 32768 * 8
    assert (up.groups, up.k, up.n) == (256, 7168, 4096) and down.k == 2048
    assert gg.shapes("deepseek")[0].rows == CONFIGS["deepseek"].tokens * 8
    with pytest.raises(ValueError, match="must be positive"):
        gg.shapes("deepseek", 0)
    with pytest.raises(ValueError, match="whole number of 128-tiles"):
        gg.time_shape(gg.shapes("deepseek", 8192 + 16)[0])
    with pytest.raises(SystemExit):
        gg.main(["--configs", "deepseek", "--tokens", "-8"])
