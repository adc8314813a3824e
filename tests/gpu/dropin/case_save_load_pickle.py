"""torch.save / torch.load of CUDA tensors, plain pickle and copy.deepcopy of CUDA tensors and
modules (no torch.multiprocessing involved).

With PyTorch's allocator: a checkpoint with views sharing one storage and tied parameters
loads back on CUDA with the values, the views still sharing one storage (data_ptr offsets
kept) and the tied weights still one tensor; map_location="cpu" works; pickle.loads(
pickle.dumps(t)) of a CUDA tensor is an independent CUDA copy (writing it leaves t alone);
copy.deepcopy(model) is independent too.

Why vmm may differ: vmm installs reducers (ForkingPickler) and patches queue puts when
VMM_TORCH_ENABLE is set; anything that leaks into plain pickling changes what a pickle of a
CUDA tensor is (a copy, not a mapping of the same memory).
"""
import copy
import io
import pickle

import torch
from dropin_report import report


def main():
    torch.manual_seed(0)
    errors = []
    base = torch.arange(1000.0, device="cuda")
    emb = torch.nn.Embedding(50, 16).cuda()
    head = torch.nn.Linear(16, 50, bias=False).cuda()
    head.weight = emb.weight  # tied
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    ckpt = {"base": base, "view": base[100:200], "strided": base[::7], "model": model.state_dict()}
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    buf.seek(0)
    got = torch.load(buf, weights_only=True)
    if not (got["base"].is_cuda and torch.equal(got["base"], base)):
        errors.append("the loaded base tensor differs")
    if got["view"].data_ptr() - got["base"].data_ptr() != 100 * 4:
        errors.append("the loaded view does not share the base's storage at offset 100")
    if not torch.equal(got["strided"], base[::7]):
        errors.append("the loaded strided view differs")
    sd = got["model"]
    if sd["emb.weight"].data_ptr() != sd["head.weight"].data_ptr():
        errors.append("tied weights are no longer one tensor after torch.load")
    buf.seek(0)
    cpu = torch.load(buf, map_location="cpu", weights_only=True)
    if cpu["base"].is_cuda or not torch.equal(cpu["base"], base.cpu()):
        errors.append("map_location='cpu' failed")
    t = torch.full((4096,), 3.0, device="cuda")
    u = pickle.loads(pickle.dumps(t))
    u.fill_(9.0)
    torch.cuda.synchronize()
    if not u.is_cuda or float(t.sum().item()) != 3.0 * 4096:
        errors.append("pickle.loads(pickle.dumps(t)) is not an independent CUDA copy")
    if u.data_ptr() == t.data_ptr():
        errors.append("the unpickled tensor has t's address")
    m2 = copy.deepcopy(model)
    with torch.no_grad():
        m2["emb"].weight.add_(1.0)
    if torch.equal(m2["emb"].weight, model["emb"].weight):
        errors.append("deepcopy of a CUDA module shares memory with the original")
    if m2["emb"].weight.data_ptr() != m2["head"].weight.data_ptr():
        errors.append("deepcopy lost the tie")
    report(errors)


if __name__ == "__main__":
    main()
