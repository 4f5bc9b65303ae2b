"""Engine-neutral helpers of the model-class tests (``test_vllm_model_classes.py``,
``test_sglang_model_classes.py``)."""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from unittest import mock


def without_marker(ckpt, converted, root):
    """A conversion whose ``config.json`` lost its marker (the source's put back), recorded so in its
    sealed manifest: only the marker would have said what it is."""
    from megamoe_convert.output.seal import SEAL_KEY, seal
    from megamoe_convert.output.writer import file_checksum

    out = root / "marker-lost"
    shutil.copytree(converted, out)
    shutil.copy(ckpt / "config.json", out / "config.json")
    data = json.loads((out / "manifest.json").read_bytes())
    del data[SEAL_KEY]
    (record,) = [f for f in data["files"] if f["path"] == "config.json"]
    record.update(size=(out / "config.json").stat().st_size, checksum=file_checksum(out / "config.json"))
    (out / "manifest.json").write_text(seal(data))
    return out


@contextmanager
def hub_repos(root, monkeypatch, **repos):
    """``repos`` (``owner/name`` -> a directory) on the project's fake hub, and in the HF cache what
    the engine downloaded before the model is built (``config.json``, the weights, their index), but
    not ``manifest.json`` (the plugin fetches it where it needs it). Inside: offline, as the engine and
    transformers then read that cache."""
    import huggingface_hub
    from hub_fake import FakeHub, cache_put

    hub = FakeHub(root / "hub").install(monkeypatch, root / "cache")
    api = hub.api()
    for repo_id, folder in repos.items():
        api.create_repo(repo_id)
        api.upload_folder(repo_id=repo_id, folder_path=folder)
        files = {rel: path for rel, path in hub.files(repo_id).items() if rel != "manifest.json"}
        cache_put(root / "cache", repo_id, hub.resolve(repo_id, None), files)
    with mock.patch.object(huggingface_hub.constants, "HF_HUB_OFFLINE", True):
        yield hub
