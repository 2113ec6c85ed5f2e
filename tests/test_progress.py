"""Progress bars (rich, on stderr) while a checkpoint is written, hashed, verified and loaded."""
from inference.model import ModelConfig, make_random_checkpoint
from inference.model.checkpoint import verify_manifest
from inference.model.progress import byte_progress


def test_writing_hashing_verifying_and_loading_show_progress_on_stderr(tmp_path, capfd):
    make_random_checkpoint(ModelConfig.tiny(), tmp_path / "ckpt", seed=0, progress=True)
    out, err = capfd.readouterr()
    assert out == "" and "writing" in err and "hashing" in err and "100%" not in out
    verify_manifest(tmp_path / "ckpt", progress=True)
    assert "verifying" in capfd.readouterr().err
    make_random_checkpoint(ModelConfig.tiny(), tmp_path / "quiet", seed=0, progress=False)
    assert capfd.readouterr().err == ""


def test_a_disabled_bar_prints_nothing(capfd):
    with byte_progress("loading", 10, enabled=False) as advance:
        advance(10)
    with byte_progress("loading", 2048, enabled=True) as advance:
        advance(2048)
    err = capfd.readouterr().err
    assert err.count("loading") == 1 and "2.0/2.0 kB" in err
