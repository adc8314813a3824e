"""vmm_torch._settings: allocator settings given at run time while vmm is PyTorch's CUDA
allocator (a backend item naming the start-up backend is left out; everything else goes to
PyTorch as given)."""

import pytest
import torch

from vmm_torch import _settings


@pytest.mark.parametrize("text, items", [
    ("", [""]),
    ("backend:native", ["backend:native"]),
    ("a:1,b:2", ["a:1", "b:2"]),
    ("roundup_power2_divisions:[256:1,512:2,>:1],backend:native",
     ["roundup_power2_divisions:[256:1,512:2,>:1]", "backend:native"]),
    ("x:[1,[2,3]],y:4", ["x:[1,[2,3]]", "y:4"]),
])
def test_items_split_at_commas_outside_brackets(text, items):
    assert _settings.split_items(text) == items


@pytest.mark.parametrize("environ, backend", [
    ({}, "native"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "native"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}, "cudaMallocAsync"),
    ({"PYTORCH_ALLOC_CONF": " backend : native ,max_split_size_mb:64"}, "native"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "backend:", "PYTORCH_ALLOC_CONF": ""}, "native"),
])
def test_the_startup_backend_is_what_the_variables_name(environ, backend):
    assert _settings.startup_backend(environ) == backend


@pytest.mark.parametrize("text, left", [
    ("backend:native", None),
    (" backend : native ", None),
    ("backend:native,expandable_segments:False", "expandable_segments:False"),
    ("expandable_segments:False,backend:native", "expandable_segments:False"),
    ("roundup_power2_divisions:[256:1,512:2],backend:native",
     "roundup_power2_divisions:[256:1,512:2]"),
    # Unchanged: no such item, another backend (PyTorch refuses it with either allocator),
    # malformed text (PyTorch says what is wrong with it).
    ("expandable_segments:False", "expandable_segments:False"),
    ("backend:cudaMallocAsync", "backend:cudaMallocAsync"),
    ("", ""),
    ("garbage", "garbage"),
    ("backend_x:native", "backend_x:native"),
])
def test_only_the_startup_backend_is_left_out(text, left):
    assert _settings.without_startup_backend(text, "native") == left


def test_the_wrapper_passes_the_rest_and_returns_what_pytorch_returns():
    calls = []

    def setter(env):
        calls.append(env)
        return "result"

    wrapped = _settings.wrap(setter, "native")
    assert wrapped("backend:native") is None and calls == []
    assert wrapped("backend:native,garbage_collection_threshold:0.5") == "result"
    assert wrapped("backend:cudaMallocAsync") == "result"
    assert calls == ["garbage_collection_threshold:0.5", "backend:cudaMallocAsync"]
    assert wrapped.__wrapped__ is setter

    def failing(env):
        raise RuntimeError(f"refused {env}")

    with pytest.raises(RuntimeError, match="refused bogus:1"):
        _settings.wrap(failing, "native")("bogus:1,backend:native")


def test_install_wraps_the_function_where_torch_holds_it_once(monkeypatch):
    import torch.cuda.memory as memory

    calls = []

    def setter(env):
        calls.append(env)

    monkeypatch.setattr(memory, "_set_allocator_settings", setter, raising=False)
    monkeypatch.setattr(torch.cuda, "_set_allocator_settings", setter, raising=False)
    monkeypatch.setattr(_settings, "_installed", False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    _settings.install()
    _settings.install()  # once
    assert memory._set_allocator_settings.__wrapped__ is setter
    assert torch.cuda._set_allocator_settings is memory._set_allocator_settings
    memory._set_allocator_settings("backend:native,expandable_segments:False")
    assert calls == ["expandable_segments:False"]
