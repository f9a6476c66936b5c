"""`StoragePark`, the mechanism under the trainer offload and serve-local's memory release, on the
training device (CPU here; CUDA in scripts/gpu_checks.sh): shared storages park once, views survive,
bytes come back exactly, the device memory is returned and, on a GPU, the host buffer is page-locked."""

import torch

from megatron_armor.distributed.device import training_device
from megatron_armor.utils.storage_park import StoragePark


def test_views_survive_a_park_and_get_their_bytes_back():
    device = training_device()
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(1000, generator=g).to(device)
    views = [flat[:300].view(10, 30), flat[300:]]  # two views of one storage: parked once
    odd = torch.randint(-100, 100, (7, 3), generator=g, dtype=torch.int64).to(device)
    half = torch.randn(5, 11, generator=g).to(device, torch.bfloat16)
    tensors = [*views, odd, half]
    before = [t.clone() for t in tensors]
    park = StoragePark(lambda: tensors, device)
    allocated = torch.cuda.memory_allocated(device) if device.type == "cuda" else None

    park.park()
    assert park.is_parked and park.parked_bytes == 1000 * 4 + 21 * 8 + 55 * 2
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
    assert park.host.numel() == park.parked_bytes
    if device.type == "cuda":
        assert torch.cuda.memory_allocated(device) <= allocated - park.parked_bytes  # blocks round up
        assert park.host.is_pinned()  # registered with cudaHostRegister
    park.park()  # idempotent: the host copy is not overwritten by empty storages
    park.restore()
    assert not park.is_parked
    assert all(t.dtype == b.dtype and torch.equal(t, b) for t, b in zip(tensors, before, strict=True))
    views[0].add_(1.0)  # the views still share one storage after the restore
    assert torch.equal(flat[:300], before[0].reshape(-1) + 1.0)

    host = park.host
    park.park()
    assert park.host is host  # same sizes: the host buffer is reused
    park.restore()
    assert torch.equal(views[1], before[1])


def test_a_park_without_values_frees_without_a_host_copy():
    device = training_device()
    weight = torch.ones(64, 8, device=device)
    tied = weight.view(-1)  # a second view of the same storage
    park = StoragePark(lambda: [weight, tied], device)
    allocated = torch.cuda.memory_allocated(device) if device.type == "cuda" else None

    park.park(keep_values=False)
    assert park.parked_bytes == 64 * 8 * 4 and weight.untyped_storage().nbytes() == 0
    assert park.host.numel() == 0  # nothing copied out
    if device.type == "cuda":
        assert torch.cuda.memory_allocated(device) <= allocated - park.parked_bytes
    park.restore()
    assert weight.untyped_storage().nbytes() == 64 * 8 * 4  # reallocated, values undefined
    weight.fill_(2.0)
    assert torch.equal(tied, torch.full((512,), 2.0, device=device))  # the views share it again

    park.park()  # a later park that keeps values works as before
    park.restore()
    assert torch.equal(weight, torch.full((64, 8), 2.0, device=device))
