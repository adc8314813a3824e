"""User-written Triton kernels (@triton.jit, launched as kernel[grid](...)) on memory from the
CUDA allocator: what custom fused ops, quantization kernels and attention variants do.
Triton's launcher checks every tensor argument's pointer with
cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_POINTER) and raises "Pointer argument
cannot be accessed from Triton" when the driver does not know it, and the kernels read and
write straight through the pointers.

With PyTorch's allocator (cudaMalloc'd segments): an elementwise kernel gives a*2+b on tensors
of 1 KiB to 600 MiB (the largest spans many of any allocator's chunks), on views whose data
pointer lies at odd offsets inside a larger buffer (1 element and 2 MiB - 4 bytes in, across
the 2 MiB boundaries of the buffer), on tensors made and launched on a side stream, on a raw
block of caching_allocator_alloc wrapped as a tensor, and on a tensor made inside a MemPool;
a kernel with atomic adds sums a 256 MiB tensor into one float exactly as torch.sum does to
float32 tolerance; a block that is freed and reused by the next tensor is written again by a
kernel without error.

Why vmm may differ: vmm's memory is cuMemCreate'd chunks mapped side by side into one
reserved range, and a pool may move pages: a pointer the driver does not report as device
memory, or a mapping whose access flags do not cover the whole range a tensor spans, makes
Triton refuse the argument or the kernel fault where cudaMalloc'd memory works.
"""
import subprocess

import torch
from dropin_report import in_pool, report
from raw_memory import wrap

MIB = 1 << 20

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:
    @triton.jit
    def axpy(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        a = tl.load(a_ptr + offs, mask=mask)
        b = tl.load(b_ptr + offs, mask=mask)
        tl.store(out_ptr + offs, a * 2.0 + b, mask=mask)

    @triton.jit
    def total(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        tl.atomic_add(out_ptr, tl.sum(x, axis=0))


def main():
    errors = []
    if triton is None:
        print("triton is not installed; nothing checked")
        report(errors)
        return

    def run_axpy(a, b, out):
        n = out.numel()
        axpy[(triton.cdiv(n, 1024),)](a, b, out, n, BLOCK=1024)

    def check(a, b, out, what):
        want = a * 2.0 + b
        if not torch.equal(out, want):
            errors.append(f"{what}: the Triton kernel's output differs from a * 2 + b")

    # Triton needs a C compiler for its launcher; a machine without one fails natively too.
    try:
        a = torch.ones(256, device="cuda")
        out = torch.empty_like(a)
        run_axpy(a, a, out)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        text = str(e)
        if (isinstance(e, subprocess.CalledProcessError) or "compiler" in text.lower()
                or "Python.h" in text):
            print(f"Triton cannot build its launcher here ({text[:200]}); nothing checked")
            report(errors)
            return
        errors.append(f"the first Triton kernel raised {type(e).__name__}: {text[:300]}")
        report(errors)
        return

    # Sizes from 1 KiB to 600 MiB.
    for nbytes in (1024, 3 * MIB + 4, 64 * MIB, 600 * MIB):
        n = nbytes // 4
        try:
            a = torch.arange(n, device="cuda", dtype=torch.float32) % 1000
            b = torch.full((n,), 0.5, device="cuda")
            out = torch.empty(n, device="cuda")
            run_axpy(a, b, out)
            check(a, b, out, f"{nbytes} bytes")
        except Exception as e:  # noqa: BLE001
            errors.append(f"{nbytes} bytes: {type(e).__name__}: {str(e)[:300]}")
        a = b = out = None

    # Views at odd offsets inside a buffer, across its 2 MiB boundaries.
    buf = torch.arange(3 * (16 * MIB // 4), device="cuda", dtype=torch.float32) % 977
    third = 16 * MIB // 4
    for off in (1, 2 * MIB // 4 - 1, 4 * MIB // 4 + 3):
        a = buf[off: off + 3 * MIB // 4]
        b = buf[third + off: third + off + 3 * MIB // 4]
        out = buf[2 * third + off: 2 * third + off + 3 * MIB // 4]
        try:
            run_axpy(a, b, out)
            want = a * 2.0 + b
            torch.cuda.synchronize()
            if not torch.equal(out, want):
                errors.append(f"views at element offset {off}: wrong output")
        except Exception as e:  # noqa: BLE001
            errors.append(f"views at element offset {off}: {type(e).__name__}: {str(e)[:300]}")
    del buf, a, b, out

    # A side stream.
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        a = torch.randn(8 * MIB // 4, device="cuda")
        b = torch.randn(8 * MIB // 4, device="cuda")
        out = torch.empty_like(a)
        run_axpy(a, b, out)
        want = a * 2.0 + b
    side.synchronize()
    if not torch.equal(out, want):
        errors.append("a kernel launched on a side stream gave a wrong output")
    del a, b, out, want

    # A raw block and a MemPool tensor.
    n = 4 * MIB // 4
    ptr = torch.cuda.caching_allocator_alloc(n * 4)
    try:
        raw = wrap(ptr, n)
        a = torch.full((n,), 3.0, device="cuda")
        run_axpy(a, a, raw)
        torch.cuda.synchronize()
        if float(raw.min().item()) != 9.0 or float(raw.max().item()) != 9.0:
            errors.append("a kernel writing a raw caching_allocator_alloc block gave wrong values")
        del raw, a
    except Exception as e:  # noqa: BLE001
        errors.append(f"a raw block: {type(e).__name__}: {str(e)[:300]}")
    torch.cuda.caching_allocator_delete(ptr)
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        pa = torch.full((n,), 1.5, device="cuda")
        pout = torch.empty(n, device="cuda")
    try:
        run_axpy(pa, pa, pout)
        torch.cuda.synchronize()
        if not in_pool(pool, pout) or float(pout.max().item()) != 4.5:
            errors.append("a kernel on tensors of a MemPool gave a wrong output")
    except Exception as e:  # noqa: BLE001
        errors.append(f"a MemPool tensor: {type(e).__name__}: {str(e)[:300]}")
    del pa, pout, pool

    # Atomic adds over 256 MiB.
    x = torch.rand(256 * MIB // 4, device="cuda")
    acc = torch.zeros(1, device="cuda")
    total[(triton.cdiv(x.numel(), 4096),)](x, acc, x.numel(), BLOCK=4096)
    want = float(x.double().sum().item())
    got = float(acc.item())
    if abs(got - want) > 1e-3 * abs(want):
        errors.append(f"atomic adds over 256 MiB gave {got}, torch {want}")
    del x, acc

    # Blocks freed and reused at once.
    for i in range(50):
        a = torch.full((MIB,), float(i), device="cuda")
        out = torch.empty(MIB, device="cuda")
        run_axpy(a, a, out)
        if i % 10 == 9 and float(out.max().item()) != 3.0 * i:
            errors.append(f"reuse round {i}: wrong output")
            break
        del a, out
    torch.cuda.synchronize()
    report(errors)


if __name__ == "__main__":
    main()
