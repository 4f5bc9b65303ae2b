"""SGLang 0.5.23's elastic-EP recovery of a MegaMoE model served by hub repo id (the project's fake hub:
no network), through its own EPLB entry point and updater on every surviving rank at once.

A store on the hub is whole in the HF cache once its install pulled it: recovery reads the lost
experts' byte ranges there and downloads nothing. A per-rank conversion on the hub is in the cache
only for the ranks pulled: recovery pulls just the rank holding the lost experts, then reads their
byte ranges. Either way every kernel tensor of every surviving rank equals SGLang's own fresh build
under the new placement. A node's ranged pull of a store that lacks the lost experts' ranges gets
them by range from the repo it was pulled from (the hub module's ranged reader), or, where its
record names no repo, is refused in one line before any byte moves."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import huggingface_hub
import pytest
import sglang_harness as h
import sglang_recovery_harness as r
from hub_fake import FakeHub
from test_sglang_recovery import entry
from test_sglang_recovery_per_rank import HOLDER
from test_sglang_recovery_per_rank import served as served_per_rank

from megamoe_convert.engines.sglang import install

REPO = "owner/recovery"


@pytest.fixture
def hub(tmp_path, monkeypatch) -> FakeHub:
    """The fake hub, its downloads one at a time (the HF client locks its cache; the fake does not)."""
    fake = FakeHub(tmp_path / "hub").install(monkeypatch, tmp_path / "cache")
    lock, download = threading.Lock(), fake.snapshot_download

    def locked(*args, **kwargs):
        with lock:
            return download(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", locked)
    return fake


def pushed(hub: FakeHub, folder: Path) -> str:
    api = hub.api()
    api.create_repo(REPO)
    api.upload_folder(repo_id=REPO, folder_path=folder)
    return REPO


def served_store(ckpt: Path, repo: str, rank: int, config):
    with h.patched(rank, r.EP_SIZE, r.REDUNDANT, **r.table_args(r.OLD)):
        model = h.build_main_model(config, rank, r.REDUNDANT)
        assert install(model, repo, rank=rank) == config.num_hidden_layers
    r.served_from(model, repo)
    return r.with_routed_weights(model)


def assert_fresh_build(ckpt: Path, config, models) -> None:
    for rank, model in models.items():
        want = h.experts_of(r.fresh_build(ckpt, config, rank, r.NEW))
        for prefix, module in h.experts_of(model).items():
            for name, tensor in h.state(module).items():
                h.assert_same_tensor(tensor, h.state(want[prefix])[name], f"rank {rank} {prefix}.{name}")


def test_recovery_of_a_store_served_by_repo_id_reads_the_cached_store_and_downloads_nothing(
        sglang_ckpt, sglang_store, hub):
    config = h.hf_config(sglang_ckpt)
    repo = pushed(hub, sglang_store)
    models = {rank: served_store(sglang_ckpt, repo, rank, config) for rank in r.SURVIVORS}
    installed = list(hub.downloaded)
    assert any(path.startswith("experts/") for path in installed)
    asked = r.recover(models, config, entry(hooked=True))
    assert asked == {rank: [] for rank in r.SURVIVORS}
    assert hub.downloaded == installed and hub.ranged == []
    assert_fresh_build(sglang_ckpt, config, models)


def test_recovery_of_a_per_rank_conversion_served_by_repo_id_pulls_just_the_rank_holding_the_lost_experts(
        sglang_ckpt, sglang_converted, hub):
    config = h.hf_config(sglang_ckpt)
    repo = pushed(hub, sglang_converted)
    models = {rank: served_per_rank(sglang_ckpt, repo, rank, config) for rank in r.SURVIVORS}
    snapshot = next((Path(huggingface_hub.constants.HF_HUB_CACHE)).glob("models--*/snapshots/*"))
    shutil.rmtree(snapshot / HOLDER)  # the cache of a node running ranks 0 and 1 only
    installed = list(hub.downloaded)
    asked = r.recover(models, config, entry(hooked=True))
    assert asked == {rank: [] for rank in r.SURVIVORS}
    fetched = hub.downloaded[len(installed):]
    assert fetched and {path.partition("/")[0] for path in fetched} == {HOLDER}
    assert sorted(set(fetched)) == sorted(p for p in hub.files(repo) if p.startswith(f"{HOLDER}/"))
    assert_fresh_build(sglang_ckpt, config, models)


def node_pull(hub: FakeHub, store: Path, local: Path) -> Path:
    """A node's ranged pull (``megamoe pull --ep-size 4 --ranks 0-1``): experts 0-3 alone."""
    from megamoe_convert.hub.ranges import pull_ranges

    pull_ranges(pushed(hub, store), local, 4, "0-1", engine="sglang")
    return local


def test_recovery_from_a_nodes_ranged_pull_fetches_just_the_lost_experts_ranges_from_its_repo(
        sglang_ckpt, sglang_store, hub, tmp_path):
    """Ranks 0 and 1 serve from a ranged pull that holds experts 0-5 (their old slots); the experts they
    must restore are holes there, fetched by range from the repo and commit it was pulled from."""
    from megamoe_convert.hub.ranges import pull_ranges

    local = node_pull(hub, sglang_store, tmp_path / "node")
    pull_ranges(REPO, local, 4, "0-2", engine="sglang")  # rank 2's slots too: experts 0-5
    config = h.hf_config(sglang_ckpt)
    models = {rank: served_store(sglang_ckpt, local, rank, config) for rank in r.SURVIVORS}
    pulled = len(hub.ranged)
    asked = r.recover(models, config, entry(hooked=True))
    assert asked == {rank: [] for rank in r.SURVIVORS}
    fetched = hub.ranged[pulled:]
    assert fetched and {path for path, _, _ in fetched} == {"experts/layers.0.safetensors",
                                                            "experts/layers.1.safetensors"}
    block = sum(getattr(next(iter(h.experts_of(models[0]).values())), n)[0].nbytes
                for n in ("w13_weight", "w2_weight", "mega_w13_weight_scale_utccp", "mega_w2_weight_scale_utccp"))
    assert sum(n for _, _, n in fetched) <= 2 * 2 * block * 1.05  # experts 6 and 7 of two layers, gaps merged
    assert_fresh_build(sglang_ckpt, config, models)


def test_recovery_refuses_a_ranged_pull_that_names_no_repo_before_any_byte_moves(
        sglang_ckpt, sglang_store, hub, tmp_path):
    """A ranged pull whose record names no repo (an older pull's) holds experts 0-3 alone: rank 0 serves
    from it, but the experts it must restore are holes there and nothing says where to fetch them."""
    local = node_pull(hub, sglang_store, tmp_path / "node")
    record = local / ".megamoe" / "ranges.json"
    data = json.loads(record.read_text())
    del data["repo_id"]
    record.write_text(json.dumps(data))
    config = h.hf_config(sglang_ckpt)
    model = served_store(sglang_ckpt, local, 0, config)
    error, untouched = r.refusal(model, config, entry(hooked=True))
    assert "were not pulled" in str(error) and "records no repo" in str(error)
    assert untouched
