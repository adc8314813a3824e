"""A torch.multiprocessing Pool(processes=2, maxtasksperchild=1) (spawn) whose tasks get CUDA
tensors inside a dataclass holding a dict of more CUDA tensors (a job description: weights,
an output slot that is a view of one shared buffer, a bias and index tensors in a dict) and
write their result in place into the parent's output buffer; each worker runs one task and
exits, so every task is opened by a new process (worker recycling, as servers use against
leaks). Results are plain Python values (a returned CPU or CUDA tensor would need its
exited producer to stay alive: PyTorch's "Note [Sharing CUDA tensors]").

With PyTorch's allocator each fresh worker maps the parent's blocks (CUDA IPC, the parent
is the producer and stays alive), computes weight * k * 2.5 + bias[idx], writes it into its
row of the parent's buffer and returns its pid and exact sums; six tasks run in six distinct
worker processes; the parent sees every row written, its inputs unchanged; after the parent
drops the first jobs' tensors (the exited workers held them) and makes new ones of the same
sizes, the second round's workers see the new values, not the old.

Why vmm may differ: a send to a process that exits right after its task (its holds released
by its exit, not by a free), the next sends of blocks of the same sizes while the earlier
ones' releases are pending, writes into a view of a block that is sent many times to
different processes, and sends pickled in the pool's task-handler thread.
"""
import dataclasses
import os

import torch
import torch.multiprocessing as mp
from dropin_report import report

N = 1 << 16  # float32 elements per row
ROUND1, ROUND2 = 4, 2


@dataclasses.dataclass
class Job:
    k: int
    weight: torch.Tensor
    out: torch.Tensor
    extras: dict


def task(job):
    bias = job.extras["bias"]
    idx = job.extras["idx"]
    r = job.weight * float(job.k) * job.extras["scale"] + bias[idx]
    job.out.copy_(r)
    torch.cuda.synchronize()  # the parent reads the row once this task's result arrives
    return (os.getpid(), job.k, float(r.double().sum().item()),
            float(job.weight.double().sum().item()), tuple(job.out.shape))


def expected_row(weight, k, bias, idx):
    return weight.double() * k * 2.5 + bias.double()[idx]


def make_jobs(ks, outbuf, offset):
    jobs = []
    for j, k in enumerate(ks):
        weight = (torch.arange(N, device="cuda") % (97 + k)).float() + offset
        bias = torch.arange(64, device="cuda", dtype=torch.float32) * (k + 1)
        idx = torch.arange(N, device="cuda") % 64
        jobs.append(Job(k, weight, outbuf[j], {"bias": bias, "idx": idx, "scale": 2.5,
                                               "name": f"job{k}"}))
    return jobs


def check(round_name, jobs, results, outbuf, errors):
    pids = set()
    for job, (pid, k, rsum, wsum, shape) in zip(jobs, results):
        pids.add(pid)
        want = expected_row(job.weight, job.k, job.extras["bias"], job.extras["idx"])
        if k != job.k or shape != (N,):
            errors.append(f"{round_name}: result for job {job.k} says k={k}, shape {shape}")
        if rsum != float(want.sum().item()):
            errors.append(f"{round_name}: job {job.k}: the worker's sum {rsum}, expected "
                          f"{float(want.sum().item())}")
        if wsum != float(job.weight.double().sum().item()):
            errors.append(f"{round_name}: job {job.k}: the worker saw weights summing to {wsum}, "
                          f"the parent's sum to {float(job.weight.double().sum().item())}")
    torch.cuda.synchronize()
    for j, job in enumerate(jobs):
        want = expected_row(job.weight, job.k, job.extras["bias"], job.extras["idx"])
        if not torch.equal(outbuf[j].double(), want):
            errors.append(f"{round_name}: row {j} of the parent's buffer is not what the "
                          f"worker of job {job.k} wrote")
    if os.getpid() in pids or len(pids) != len(jobs):
        errors.append(f"{round_name}: {len(jobs)} tasks ran in {len(pids)} distinct workers "
                      f"(maxtasksperchild=1: one each)")
    return pids


def main():
    errors = []
    ctx = mp.get_context("spawn")
    outbuf = torch.zeros(ROUND1, N, device="cuda")
    pool = ctx.Pool(processes=2, maxtasksperchild=1)
    try:
        jobs = make_jobs(range(1, ROUND1 + 1), outbuf, 0.0)
        copies = [job.weight.clone() for job in jobs]
        results = pool.map_async(task, jobs, chunksize=1).get(timeout=45)
        pids1 = check("round 1", jobs, results, outbuf, errors)
        if not all(torch.equal(job.weight, c) for job, c in zip(jobs, copies)):
            errors.append("round 1: a worker changed the parent's weights")
        del jobs, copies, results
        torch.cuda.ipc_collect()
        outbuf.zero_()
        jobs = make_jobs(range(11, 11 + ROUND2), outbuf, 1000.0)  # same sizes, new values
        results = sorted(pool.imap_unordered(task, jobs, chunksize=1), key=lambda r: r[1])
        pids2 = check("round 2", jobs, results, outbuf, errors)
        if pids1 & pids2:
            errors.append(f"round 2 ran in workers of round 1 ({pids1 & pids2})")
        if not bool((outbuf[ROUND2:] == 0).all()):
            errors.append("rows no round-2 task was given changed")
        del jobs, results
        pool.close()
        pool.join()
    except Exception as e:  # noqa: BLE001
        errors.append(f"{type(e).__name__}: {str(e)[:400]}")
        pool.terminate()
    report(errors[:12])


if __name__ == "__main__":
    main()
