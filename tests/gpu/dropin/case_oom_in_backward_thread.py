"""An out-of-memory error raised inside loss.backward() and caught by the training script,
which goes on: a fine-tuning job under a memory cap (a GPU shared with another job) whose
first layer's weight gradient does not fit freezes that layer and retries, then gets the
whole GPU back and trains every layer.

Autograd runs the backward of CUDA nodes on a thread of its own (one per device), so the
request that fails is made by that thread; the engine re-raises its error in the thread that
called backward(). With PyTorch's allocator, the process capped by
set_per_process_memory_fraction at what it holds plus 512 MiB, and a model of a
16384 x 16384 Linear without bias (1 GiB of float32 weight; its input needs no grad), a ReLU
and a 16384 x 16 Linear: the forward fits and loss.backward() raises
torch.cuda.OutOfMemoryError (the 1 GiB weight gradient does not fit), memory_stats()
["num_ooms"] grows; once the gradients are set to None memory_allocated() is back at its value
before the step; with the big layer frozen (requires_grad_(False)) the same step fits under
the cap, gives the loss of an uncapped step and the small layer its gradient (the big one
none); unfrozen, backward raises again; with the cap lifted the full step fits and both
gradients equal the uncapped step's (the big one's first 8 rows compared); at the end
memory_allocated() is back at its value before the first capped step.

Why vmm may differ: the failing request reaches VmmAllocator::Malloc from autograd's device
thread, which must trim vmm's cache, refuse the growth past the cap (device_cap.h) and throw
c10::OutOfMemoryError there (another exception type reaches the caller as another Python
type), leaving no block or partial growth behind; the cuBLAS workspace of that thread, and
every block of its backward, are vmm's too.
"""
import gc

import torch
from dropin_report import report

MIB = 1 << 20
D, B, K = 16384, 64, 16


def settle():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def attempt(model, x):
    """One step: (loss, None), or (None, what was raised and where)."""
    phase = "forward"
    try:
        loss = model(x).square().mean()
        phase = "backward"
        loss.backward()
        return float(loss.item()), None
    except torch.cuda.OutOfMemoryError:
        return None, f"OutOfMemoryError in {phase}"
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__} in {phase}: {str(e).splitlines()[0][:200]}"


def close(a, b, tol=1e-4):
    return torch.allclose(a, b, rtol=tol, atol=1e-7)


def main():
    errors = []
    torch.manual_seed(0)
    big = torch.nn.Linear(D, D, bias=False, device="cuda")
    small = torch.nn.Linear(D, K, device="cuda")
    model = torch.nn.Sequential(big, torch.nn.ReLU(), small)
    x = torch.randn(B, D, device="cuda")

    # Uncapped: the reference step (it also makes both threads' cuBLAS workspaces).
    ref_loss, err = attempt(model, x)
    if err:
        errors.append(f"the uncapped step raised {err}")
        report(errors)
    ref_small = small.weight.grad.clone()
    ref_rows = big.weight.grad[:8].clone()
    model.zero_grad(set_to_none=True)
    settle()
    base = torch.cuda.memory_allocated()
    ooms0 = torch.cuda.memory_stats().get("num_ooms", 0)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 512 * MIB) / total)

    for attempt_no in (1, 2):
        loss, err = attempt(model, x)
        if err != "OutOfMemoryError in backward":
            errors.append(f"capped step {attempt_no} (a 1 GiB gradient over a 512 MiB margin): "
                          f"expected OutOfMemoryError in backward, got {err or 'no error'}")
        model.zero_grad(set_to_none=True)
        settle()
        if torch.cuda.memory_allocated() != base:
            errors.append(f"after the OOM in backward {attempt_no} and zero_grad, "
                          f"memory_allocated() is {torch.cuda.memory_allocated()}, was {base}")
        if attempt_no == 2:
            break
        big.weight.requires_grad_(False)
        loss, err = attempt(model, x)
        if err:
            errors.append(f"with the big layer frozen the capped step raised {err}")
        else:
            if abs(loss - ref_loss) > 1e-5 * abs(ref_loss):
                errors.append(f"frozen step: loss {loss}, uncapped {ref_loss}")
            if small.weight.grad is None or not close(small.weight.grad, ref_small):
                errors.append("frozen step: the small layer's gradient differs from the "
                              "uncapped step's")
            if big.weight.grad is not None:
                errors.append("frozen step: the frozen layer got a gradient")
        model.zero_grad(set_to_none=True)
        big.weight.requires_grad_(True)

    ooms = torch.cuda.memory_stats().get("num_ooms", 0) - ooms0
    if ooms < 2:
        errors.append(f"num_ooms grew by {ooms} over two OOMs in backward")
    torch.cuda.set_per_process_memory_fraction(1.0)
    loss, err = attempt(model, x)
    if err:
        errors.append(f"with the cap lifted the full step raised {err}")
    else:
        if abs(loss - ref_loss) > 1e-5 * abs(ref_loss):
            errors.append(f"uncapped again: loss {loss}, first {ref_loss}")
        if not close(small.weight.grad, ref_small) or not close(big.weight.grad[:8], ref_rows):
            errors.append("uncapped again: the gradients differ from the first uncapped step's")
    model.zero_grad(set_to_none=True)
    settle()
    if torch.cuda.memory_allocated() != base:
        errors.append(f"at the end memory_allocated() is {torch.cuda.memory_allocated()}, "
                      f"was {base} before the capped steps")
    report(errors)


if __name__ == "__main__":
    main()
