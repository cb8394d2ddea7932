"""Same params and code, two clones at different paths: byte-identical data, adapter, merged model and metrics."""
from conftest import SHORT_RUN_OUTPUTS


def test_two_clones_produce_the_same_bytes(short_runs):
    first, second = short_runs  # SHORT_RUN, each clone reproduced up to merge
    for clone in (first, second):
        assert str(clone.repo) not in clone.files["models/adapter/adapter_config.json"].decode()
        assert "seconds" not in clone.files["metrics/train.json"].decode()
    assert set(first.md5s) == set(SHORT_RUN_OUTPUTS)
    assert first.md5s == second.md5s
