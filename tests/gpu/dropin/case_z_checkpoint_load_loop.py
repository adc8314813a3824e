"""Checkpoints saved and loaded over and over in one process: an evaluation loop or a
hyper-parameter sweep that torch.load()s a checkpoint of CUDA tensors for each trial
(map_location given as "cuda", "cuda:0", torch.device, a dict and a function, as the
libraries that load checkpoints spell it), a trainer that keeps the best model by
torch.save()ing its state_dict to memory every few steps, a file loaded with mmap=True
straight onto the GPU, and model.load_state_dict(..., assign=True) swapping loaded tensors in
for a model's parameters.

With PyTorch's allocator each storage loaded onto the GPU is a block of at least its bytes
(memory_allocated() grows by at least the checkpoint's bytes while the loaded dict lives),
every form of map_location gives CUDA tensors on device 0 with the saved values and the
saved sharing (a view still shares its base's storage at the same offset), and once a
loaded dict is dropped its memory is free again: 40 loads in a row leave memory_allocated()
where it was after the first load was dropped, a save to memory of CUDA tensors allocates
nothing on the GPU that outlives it, and after everything is dropped and empty_cache() ran,
memory_allocated() is back at its baseline and memory_reserved() is no higher than it was.
load_state_dict(assign=True) makes the parameters the loaded tensors (their data_ptr()), so
the model's old parameters are freed (memory_allocated() drops by at least their bytes).

Why vmm may differ: every load is a burst of allocations of the checkpoint's sizes freed
together (a pattern that a pool rounding sizes to chunks or keeping freed blocks apart, per
stream or per send, may not reuse, and so grows), and the copies from host memory run on
the current stream while the blocks they fill were just handed out.
"""
import io
import os
import tempfile

import torch
from dropin_report import baseline, memory_back, report, settle

MIB = 1 << 20


def make_checkpoint():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.GELU(),
                                torch.nn.Linear(2048, 1024), torch.nn.LayerNorm(1024)).cuda()
    flat = torch.arange(3 * MIB, dtype=torch.float32, device="cuda")
    ckpt = {"model": model.state_dict(), "flat": flat, "view": flat[MIB:2 * MIB],
            "step": 1234, "small": torch.tensor([1.5, 2.5], device="cuda"),
            "half": torch.randn(777, 333, device="cuda").half(),
            "ints": torch.randint(0, 1000, (100_000,), device="cuda")}
    return model, ckpt


def nbytes_of(obj):
    seen, total = set(), 0
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


def check_loaded(where, got, ckpt, errors):
    for key in ("flat", "view", "small", "half", "ints"):
        t = got[key]
        if not t.is_cuda or t.device.index != 0:
            errors.append(f"{where}: {key} loaded on {t.device}")
            return
        if not torch.equal(t, ckpt[key]):
            errors.append(f"{where}: {key} differs from what was saved")
            return
    for name, t in ckpt["model"].items():
        if not torch.equal(got["model"][name], t):
            errors.append(f"{where}: model.{name} differs from what was saved")
            return
    if got["view"].data_ptr() - got["flat"].data_ptr() != MIB * 4:
        errors.append(f"{where}: the view no longer shares its base's storage at offset "
                      f"{MIB * 4}")
    if got["step"] != 1234:
        errors.append(f"{where}: the step is {got['step']}")


def main():
    errors = []
    # The kernels and cuBLAS/cuBLASLt workspaces the model's forward uses at the end, made
    # before the baseline (they stay allocated for the process's life).
    warm, _ = make_checkpoint()
    warm(torch.randn(64, 1024, device="cuda")).sum().item()
    del warm, _
    base, res0, count0 = baseline()
    model, ckpt = make_checkpoint()
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    data = buf.getvalue()
    size = nbytes_of(ckpt)
    maps = ["cuda", "cuda:0", torch.device("cuda", 0), {"cuda:0": "cuda:0"},
            lambda storage, loc: storage.cuda(0), None]

    settle()
    held = torch.cuda.memory_allocated()
    got = torch.load(io.BytesIO(data), map_location="cuda", weights_only=True)
    torch.cuda.synchronize()
    grew = torch.cuda.memory_allocated() - held
    if grew < size:
        errors.append(f"a loaded checkpoint of {size} bytes grew memory_allocated() by {grew}")
    check_loaded("first load", got, ckpt, errors)
    del got
    settle()
    after_first = torch.cuda.memory_allocated()
    if after_first != held:
        errors.append(f"the first loaded checkpoint dropped left memory_allocated() at "
                      f"{after_first}, {held} before")
    for i in range(40):
        got = torch.load(io.BytesIO(data), map_location=maps[i % len(maps)], weights_only=False)
        if i % 7 == 0:
            check_loaded(f"load {i} (map_location={maps[i % len(maps)]!r})", got, ckpt, errors)
        # Half the rounds work on the loaded tensors and save again, as a trainer that keeps
        # the best checkpoint in memory does.
        if i % 2:
            got["flat"].mul_(2)
            out = io.BytesIO()
            torch.save({"flat": got["flat"], "model": got["model"]}, out)
        del got
        if i % 10 == 9:
            torch.cuda.synchronize()
            now = torch.cuda.memory_allocated()
            if now != after_first:
                errors.append(f"after {i + 1} loads dropped memory_allocated() is {now}, "
                              f"{after_first} after the first")
                break

    # A file loaded with mmap=True onto the GPU.
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt.pt")
        torch.save(ckpt, path)
        for _ in range(3):
            got = torch.load(path, map_location="cuda", mmap=True, weights_only=True)
            check_loaded("a load with mmap=True", got, ckpt, errors)
            del got

    # load_state_dict(assign=True): the loaded tensors become the parameters (ckpt, which
    # holds the old parameters through its state_dict, is dropped first).
    del ckpt
    sd = torch.load(io.BytesIO(data), map_location="cuda", weights_only=True)["model"]
    settle()
    before = torch.cuda.memory_allocated()
    old_bytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    model.load_state_dict(sd, assign=True)
    settle()
    if model[0].weight.data_ptr() != sd["0.weight"].data_ptr():
        errors.append("load_state_dict(assign=True) did not make the loaded tensor the parameter")
    if before - torch.cuda.memory_allocated() < old_bytes:
        errors.append(f"load_state_dict(assign=True) freed {before - torch.cuda.memory_allocated()}"
                      f" bytes, the old parameters had {old_bytes}")
    x = torch.randn(64, 1024, device="cuda")
    if not torch.isfinite(model(x)).all():
        errors.append("the model with assigned parameters computes non-finite values")
    del model, sd, x, buf
    settle()  # memory_back() reads the statistics as they are: the cache is emptied here
    memory_back(errors, base, res0, "with every checkpoint and model dropped", count0)
    report(errors)


if __name__ == "__main__":
    main()
