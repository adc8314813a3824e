"""An asynchronous checkpoint writer: the trainer sends model.state_dict() (tied input and
output embeddings, as in GPT-2) through a queue; the writer process torch.save()s what it
received and reports what torch.load() gives back.

With PyTorch's allocator the two state_dict entries of a tied weight arrive sharing one
storage (PyTorch's receiver caches storages by IPC handle and offset), so torch.save writes
the weight once and torch.load returns the tie (same data_ptr); the checkpoint holds one
copy of the embedding.

Why vmm may differ: each tensor is a send and an import of its own; two imports of one block
share a mapping (same address), and only the receiver finding the storage it already holds
over those bytes (sharing.received_storage) gives them one storage, which torch.save keys by
its StorageImpl; without it the weight is written twice and the loaded checkpoint is untied.
"""
import io

import torch
import torch.multiprocessing as mp
from dropin_report import report

VOCAB, DIM = 1000, 64


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.mid = torch.nn.Linear(DIM, DIM)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight


def writer(q, reply):
    sd = q.get(timeout=60)
    same_storage = sd["emb.weight"].untyped_storage().data_ptr() == \
        sd["head.weight"].untyped_storage().data_ptr()
    buf = io.BytesIO()
    torch.save(sd, buf)
    nbytes = buf.tell()
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    tied = loaded["emb.weight"].data_ptr() == loaded["head.weight"].data_ptr()
    reply.put((same_storage, tied, nbytes, float(loaded["head.weight"].sum().item())))
    del sd, loaded


def main():
    torch.manual_seed(0)
    ctx = mp.get_context("spawn")
    q, reply = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=writer, args=(q, reply), daemon=True)
    p.start()
    model = TinyLM().cuda()
    q.put(model.state_dict())
    same_storage, tied, nbytes, head_sum = reply.get(timeout=90)
    errors = []
    emb_bytes = VOCAB * DIM * 4
    if not same_storage:
        errors.append("the tied weight's two entries arrived in different storages")
    if not tied:
        errors.append("torch.load of the received state_dict gives untied weights")
    if nbytes > emb_bytes * 1.5 + 64 * 1024:
        errors.append(f"the checkpoint has {nbytes} bytes: the {emb_bytes}-byte tied embedding "
                      f"was written twice")
    if abs(head_sum - float(model.emb.weight.sum().item())) > 1e-2:
        errors.append("the saved head weight differs")
    p.join(30)
    report(errors)


if __name__ == "__main__":
    main()
