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
