"""Can a verify step's flashinfer plan be made before its KV lengths are known? Plan a graph-mode tensor-core
decode wrapper (q_len_per_req rows a request) with upper-bound lengths, then write the real (shorter) page
table into its device buffers and run: compare with a plan at the real lengths (docs/journal/
2026-12-speculative-decoding-gpu.md). Run on a GPU with flashinfer, one setting a process:
`python docs/scripts/upper_plan.py '{}'` (the JSON holds extra `plan` keyword arguments)."""

import inspect
import json
import sys

import flashinfer
import torch

dev = torch.device("cuda")
torch.manual_seed(0)
sig = inspect.signature(flashinfer.BatchDecodeWithPagedKVCacheWrapper.plan)
out = {"flashinfer": flashinfer.__version__, "plan_params": [p for p in sig.parameters if p != "self"]}
Hq, Hk, D, L = 16, 8, 128, 5
slots = 400_000
k_cache = torch.randn(slots, 1, Hk, D, dtype=torch.bfloat16, device=dev)
v_cache = torch.randn(slots, 1, Hk, D, dtype=torch.bfloat16, device=dev)
ws = torch.zeros(512 * 1024 * 1024, dtype=torch.uint8, device=dev)


def table(B, width):
    return torch.randperm(slots - 1, device=dev)[: B * width].view(B, width).int() + 1


def meta(tab, lens):
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(lens), 0)
    indices = torch.cat([tab[b, :n] for b, n in enumerate(lens)])
    return indptr, indices, torch.ones(len(lens), dtype=torch.int32)


results = []
for B, lo, hi in ((32, 300, 900), (4, 3000, 8000), (1, 20000, 30000), (64, 100, 2000)):
    tab = table(B, hi + 2 * L)
    real = torch.randint(lo, hi, (B,)).tolist()
    upper = [n + int(e) for n, e in zip(real, torch.randint(0, L, (B,)).tolist())]
    q = torch.randn(B * L, Hq, D, dtype=torch.bfloat16, device=dev)
    ref_w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    ip, ix, lp = meta(tab, real)
    ref_w.plan(
        ip, ix, lp, Hq, Hk, D, 1, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, q_len_per_req=L
    )
    ref = ref_w.run(q, (k_cache, v_cache)).float()
    for extra in [json.loads(sys.argv[1])]:  # one setting a process: a fault would poison the context
        if any(key not in out["plan_params"] for key in extra):
            results.append({"B": B, "extra": extra, "skipped": "not a plan parameter"})
            continue
        ws2 = torch.zeros(512 * 1024 * 1024, dtype=torch.uint8, device=dev)
        ind_buf = torch.zeros(B * (hi + 2 * L), dtype=torch.int32, device=dev)
        ptr_buf = torch.zeros(B + 1, dtype=torch.int32, device=dev)
        last_buf = torch.ones(B, dtype=torch.int32, device=dev)
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            ws2,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=True,
            paged_kv_indptr_buffer=ptr_buf,
            paged_kv_indices_buffer=ind_buf,
            paged_kv_last_page_len_buffer=last_buf,
        )
        row = {"B": B, "extra": extra}
        try:
            # Planned at the real lengths: must equal the reference (sanity).
            w.plan(
                ip,
                ix,
                lp,
                Hq,
                Hk,
                D,
                1,
                q_data_type=torch.bfloat16,
                kv_data_type=torch.bfloat16,
                q_len_per_req=L,
                **extra,
            )
            row["same_plan_max_diff"] = (w.run(q, (k_cache, v_cache)).float() - ref).abs().max().item()
            # Planned at upper bounds, then the real page table written on the device.
            up_ip, up_ix, up_lp = meta(tab, upper)
            w.plan(
                up_ip,
                up_ix,
                up_lp,
                Hq,
                Hk,
                D,
                1,
                q_data_type=torch.bfloat16,
                kv_data_type=torch.bfloat16,
                q_len_per_req=L,
                **extra,
            )
            torch.cuda.synchronize()
            ptr_buf.copy_(ip.to(dev))
            ind_buf[: ix.numel()].copy_(ix)
            got = w.run(q, (k_cache, v_cache)).float()
            torch.cuda.synchronize()
            row["upper_plan_max_diff"] = (got - ref).abs().max().item()
            row["upper_plan_nan"] = bool(torch.isnan(got).any())
        except Exception as err:  # noqa: BLE001
            row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        results.append(row)
out["results"] = results
print(json.dumps(out))
