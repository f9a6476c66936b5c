"""SGLang tensor payloads: flattened-bucket layout, ForkingPickler over shared memory, the allowlisting unpickler."""

import base64
import io
import pickle
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from megatron_armor.rollout import tensor_serialization as ts

# Odd shapes and mixed dtypes: bf16 (2 bytes) after 15 bf16 leaves the fp32 tensor at byte 30, misaligned.
TENSORS = [
    ("a", torch.randn(3, 5).to(torch.bfloat16)),
    ("b", torch.randn(7)),
    ("c", torch.tensor(2.5)),
    ("d", torch.randn(1, 1, 3, dtype=torch.float32)),
    ("e", torch.tensor([-3, 9], dtype=torch.int64)),
]
# (start_idx, end_idx, numel) in bytes, worked out by hand: 15*2, 7*4, 1*4, 3*4, 2*8.
LAYOUT = [(0, 30, 30), (30, 58, 28), (58, 62, 4), (62, 74, 12), (74, 90, 16)]


def test_flattened_bucket_layout_is_sglangs():
    bucket = ts.flatten_bucket(TENSORS)
    flat = bucket["flattened_tensor"]
    assert flat.dtype == torch.uint8 and flat.shape == (90,)
    assert [(m.start_idx, m.end_idx, m.numel) for m in bucket["metadata"]] == LAYOUT
    assert [(m.name, tuple(m.shape), m.dtype) for m in bucket["metadata"]] == [
        (n, tuple(t.shape), t.dtype) for n, t in TENSORS
    ]
    # The bytes of each tensor, as SGLang's reconstruct_tensors reads them.
    for (start, end, _), (_, tensor) in zip(LAYOUT, TENSORS):
        assert bytes(flat[start:end].tolist()) == bytes(tensor.contiguous().untyped_storage())


def test_flatten_into_a_reused_shared_buffer():
    staging = ts.shared_buffer(100)
    bucket = ts.flatten_bucket(TENSORS, out=staging)
    assert staging.is_shared() and bucket["flattened_tensor"].data_ptr() == staging.data_ptr()
    assert torch.equal(bucket["flattened_tensor"], ts.flatten_bucket(TENSORS)["flattened_tensor"])
    with pytest.raises(ValueError, match="needs 90 bytes, the buffer holds 64"):
        ts.flatten_bucket(TENSORS, out=ts.shared_buffer(64))


def test_share_storages_moves_them_in_place_and_once():
    """Views keep their storage (now in /dev/shm) and values; tensors on it then map without a copy."""
    base = torch.randn(6, 4)
    gate, up = base.chunk(2)
    private, values = torch.randn(5), base.clone()
    assert not any(ts.maps_without_copy(t) for t in (gate, up))
    assert ts.share_storages([gate, up, base]) == base.nbytes  # one storage, counted once
    assert torch.equal(base, values) and gate.data_ptr() == base.data_ptr() and up.data_ptr() == base[3].data_ptr()
    assert all(ts.maps_without_copy(t) for t in (base, gate, up)) and not ts.maps_without_copy(private)
    assert not ts.maps_without_copy(base.t())  # not contiguous: staged
    assert ts.share_storages([base]) == 0
    before = base.data_ptr()
    ts.serialize([("gate", gate)])
    assert base.data_ptr() == before  # sent from where it is


def test_too_little_shared_memory_is_refused_before_anything_moves(monkeypatch):
    """A write past a full /dev/shm kills the process with SIGBUS: the room is checked first."""
    monkeypatch.setattr(ts.os, "statvfs", lambda path: SimpleNamespace(f_bavail=64, f_frsize=4096))  # 256 KiB
    weights = torch.randn(1 << 17)  # 512 KiB
    with pytest.raises(ts.SharedMemoryError, match=r"needs 1 MiB of shared memory, /dev/shm has 0 MiB free: enlarge"):
        ts.share_storages([weights, torch.randn(1 << 17)])
    assert not weights.is_shared()
    with pytest.raises(ts.SharedMemoryError, match="a weight-push staging buffer needs"):
        ts.shared_buffer(1 << 20)
    assert ts.shared_buffer(1 << 10).is_shared()


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_payload_round_trips_through_another_process(load_format):
    payload = ts.flatten_bucket(TENSORS, out=ts.shared_buffer(96)) if load_format else [(n, t.clone()) for n, t in TENSORS]
    text = ts.serialize(payload)
    reader = (
        "import sys, torch\n"
        "from megatron_armor.rollout import tensor_serialization as ts\n"
        f"named = ts.named_tensors_from_payload(ts.deserialize(sys.stdin.read()), {load_format!r})\n"
        "torch.save([(n, t.clone()) for n, t in named], sys.stdout.buffer)\n"
    )
    out = subprocess.run([sys.executable, "-c", reader], input=text.encode(), capture_output=True, check=True)
    got = torch.load(io.BytesIO(out.stdout))
    assert [n for n, _ in got] == [n for n, _ in TENSORS]
    for (_, g), (_, want) in zip(got, TENSORS):
        assert g.dtype == want.dtype and g.shape == want.shape and torch.equal(g, want)


def test_metadata_pickles_as_attributes_sglang_reads():
    """A real SGLang server reads meta.name, meta.shape, ... and must not need a class of ours."""
    raw = pickle.loads(pickle.dumps(ts.flatten_bucket(TENSORS[:1])["metadata"][0]))
    assert type(raw).__module__ == "types"
    assert (raw.name, raw.shape, raw.dtype, raw.start_idx, raw.end_idx, raw.numel) == (
        "a", torch.Size([3, 5]), torch.bfloat16, 0, 30, 30
    )


def test_unpickler_refuses_code_and_leaves_no_trace(os_system_payload):
    hostile, marker = os_system_payload
    with pytest.raises(ts.PayloadError, match="refers to posix.system, which this server does not unpickle"):
        ts.deserialize(hostile)
    assert not marker.exists()
    eval_payload = base64.b64encode(pickle.dumps(eval)).decode()
    with pytest.raises(ts.PayloadError, match="builtins.eval"):
        ts.deserialize(eval_payload)
    with pytest.raises(ts.PayloadError, match="not base64"):
        ts.deserialize("not base64!")


class _CudaIpcTensor:
    """Pickles as torch's reduction of a CUDA tensor does (a CUDA-IPC handle), without a GPU."""

    def __reduce__(self):
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        return rebuild_cuda_tensor, (torch.Tensor, torch.Size([2]), (1,), 0, torch.storage.TypedStorage, torch.float32, 0,
                                     b"ipc-handle", 8, 0, False, b"ref-counter", 0, b"event", True)


def test_cuda_ipc_handles_pass_the_allowlist_only_for_a_gpu_server():
    payload = base64.b64encode(pickle.dumps([("w", _CudaIpcTensor())])).decode()
    with pytest.raises(ts.PayloadError, match=r"reductions\.rebuild_cuda_tensor, which this server does not unpickle.*"
                                              r"CUDA tensors only to a server started with --device cuda"):
        ts.deserialize(payload)
    with pytest.raises(BaseException) as opened:  # past the allowlist: opening the handle needs a GPU
        ts.deserialize(payload, allow_cuda=True)
    assert "does not unpickle" not in str(opened.value)


def test_malformed_buckets_are_refused():
    bucket = ts.flatten_bucket(TENSORS)
    short = bucket["flattened_tensor"][:80]
    with pytest.raises(ts.PayloadError, match=r"tensor e .* needs 16 bytes.*\[74, 90\).* of a 80-byte bucket"):
        ts.unflatten_bucket(short, bucket["metadata"])
    with pytest.raises(ts.PayloadError, match="1-D uint8"):
        ts.unflatten_bucket(torch.zeros(90), bucket["metadata"])
    with pytest.raises(ts.PayloadError, match="dict with keys flattened_tensor and metadata"):
        ts.named_tensors_from_payload({"flattened_tensor": short}, "flattened_bucket")
    with pytest.raises(ts.PayloadError, match="list of \\(name, tensor\\) pairs"):
        ts.named_tensors_from_payload([("x", 1.0)], None)
    with pytest.raises(ts.PayloadError, match="load_format 'direct' is not supported"):
        ts.named_tensors_from_payload([], "direct")


def test_sender_pipes_close_while_a_receiver_still_maps_its_memory(tmp_path):
    """torch's shm manager daemon outlives the sender while a server maps a segment; it must not hold the
    sender's stdout, or a parent reading it (subprocess.run, as the trainer tests do) waits for the server."""
    common = textwrap.dedent(f"""
        import os, time, torch
        from megatron_armor.rollout import tensor_serialization as ts
        def put(name, text):  # atomic, so the other process never reads half a file
            open(f"{tmp_path}/{{name}}.tmp", "w").write(text)
            os.replace(f"{tmp_path}/{{name}}.tmp", f"{tmp_path}/{{name}}")
        def get(name):
            while not os.path.exists(f"{tmp_path}/{{name}}"):
                time.sleep(0.05)
            return open(f"{tmp_path}/{{name}}").read()
    """)
    sender = common + textwrap.dedent("""
        bucket = ts.flatten_bucket([("a", torch.ones(4))])
        put("payload", ts.serialize(bucket))
        get("mapped")
        print("sent")
    """)
    holder = common + textwrap.dedent("""
        bucket = ts.deserialize(get("payload"))
        put("mapped", str(bucket["flattened_tensor"].view(torch.float32).sum().item()))
        time.sleep(120)
    """)
    holding = subprocess.Popen([sys.executable, "-c", holder])
    try:
        out = subprocess.run([sys.executable, "-c", sender], capture_output=True, text=True, timeout=60, check=True)
        assert out.stdout == "sent\n" and (tmp_path / "mapped").read_text() == "4.0"
    finally:
        holding.kill()
        holding.wait()
