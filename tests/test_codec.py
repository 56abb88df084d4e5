"""The bplane-zstd codec: bit-exact round trips, its format, ratios on synthetic and trained
states, and how the store records, reopens and decides compression."""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import threading
from typing import Optional

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tiered
from tiered.codecs import BytePlaneCodec, CompressionPolicy, ZstdCodec, measure_codec, plane_width
from tiered.codecs.bplane import _raw_parts
from tiered.codecs.format import HEADER, Layout, decode_meta, encode_meta
from tiered.codecs.jobs import run_all
from tiered.codecs.planes import merge, split
from tiered.codecs.samples import KINDS, TARGETS, entropy_floor, synthetic
from tiered.io.spans import Span

from conftest import ALL_DTYPES, KiB, MiB, same_bytes

FORCE = float("-inf")
#: IEEE-style formats: (total bits, mantissa bits) of each float with elements wider than a byte.
FLOAT_FORMATS = {torch.bfloat16: (16, 7), torch.float16: (16, 10), torch.float32: (32, 23), torch.float64: (64, 52)}
COMPONENT = {torch.complex32: torch.float16, torch.complex64: torch.float32, torch.complex128: torch.float64}


@pytest.fixture(scope="module")
def pool():
    with concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="test-codec") as p:
        yield p


def special_values(dtype: torch.dtype, rng: np.random.Generator, count: int = 24) -> list[bytes]:
    """Bit patterns of +-0, +-inf, quiet and signalling NaNs with random payloads and signs,
    subnormals, the smallest normal and the largest finite value (element-sized, little-endian)."""
    base = COMPONENT.get(dtype, dtype)
    if base not in FLOAT_FORMATS:
        return []
    bits, mant = FLOAT_FORMATS[base]
    sign, exp_all, quiet = 1 << (bits - 1), ((1 << (bits - 1 - mant)) - 1) << mant, 1 << (mant - 1)
    payload = lambda: int(rng.integers(1, quiet))  # noqa: E731
    values = [0, sign, exp_all, sign | exp_all, 1, quiet, (1 << mant) - 1, 1 << mant, exp_all - 1]
    for _ in range(count):
        s = sign if rng.integers(2) else 0
        values += [s | exp_all | quiet | payload(), s | exp_all | payload(), s | payload()]
    out = [v.to_bytes(bits // 8, "little") for v in values]
    if dtype in COMPONENT:  # a complex element is two components
        out = [a + b for a, b in zip(out, reversed(out))]
    return out


def make_bytes(dtype: torch.dtype, nelems: int, seed: int, mode: str) -> torch.Tensor:
    """``nelems`` elements of ``dtype`` as uint8: "random" bytes, "specials" only, a skewed "mix"
    of a few random elements and the specials (compressible, so planes get packed), or "noisy":
    the mix with random low bytes (so low planes stay raw and high planes get packed)."""
    rng = np.random.default_rng(seed)
    size = dtype.itemsize
    if mode == "random":
        return torch.from_numpy(rng.integers(0, 256, nelems * size, dtype=np.uint8))
    pool = special_values(dtype, rng)
    if mode != "specials" or not pool:
        pool += [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(8)]
    table = np.frombuffer(b"".join(pool), np.uint8).reshape(len(pool), size)
    weights = 1.0 / np.arange(1, len(pool) + 1)
    picks = rng.choice(len(pool), nelems, p=weights / weights.sum())
    data = table[picks]
    if mode == "noisy" and nelems:
        component = COMPONENT.get(dtype, dtype).itemsize
        low = data.reshape(nelems, -1, component)[:, :, : max(component // 2, 1)]
        low[...] = rng.integers(0, 256, low.shape, dtype=np.uint8)
    return torch.from_numpy(data.reshape(-1).copy())


def split_spans(out: torch.Tensor, cuts: list[int]) -> list[Span]:
    """``out`` as consecutive spans cut at ``cuts`` (anywhere, even inside an element)."""
    points = sorted({c for c in cuts if 0 < c < out.numel()})
    bounds = [0, *points, out.numel()]
    return [Span(out[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a]


def round_trip(codec: BytePlaneCodec, data: torch.Tensor, dtype: torch.dtype, cuts: list[int]) -> Optional[float]:
    """Encode and decode; assert the bytes come back; return the ratio (None when stored raw)."""

    async def go() -> Optional[float]:
        encoded = await codec.encode(data, dtype)
        if encoded is None:
            return None
        try:
            out = torch.full_like(data, 0xA5)
            await codec.decode(encoded.buffer.view[: encoded.nbytes], encoded.meta, split_spans(out, cuts))
            assert torch.equal(out, data)
            return encoded.nbytes / data.numel()
        finally:
            encoded.close()

    return asyncio.run(go())


# ---------------------------------------------------------------------------- round trips


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(ALL_DTYPES),
    nelems=st.one_of(st.integers(0, 3), st.integers(0, 3000)),
    seed=st.integers(0, 2**32 - 1),
    mode=st.sampled_from(["random", "specials", "mix", "noisy"]),
    frame_bytes=st.sampled_from([8, 24, 64, 4096, 1 << 16]),
    force_planes=st.booleans(),
    force_entry=st.booleans(),
    cuts=st.lists(st.integers(0, 48_000), max_size=4),
)
def test_round_trip_is_bit_exact(pool, dtype, nelems, seed, mode, frame_bytes, force_planes, force_entry, cuts):
    data = make_bytes(dtype, nelems, seed, mode)
    codec = BytePlaneCodec(
        pool,
        frame_bytes=frame_bytes,
        min_saving=FORCE if force_entry else 0.05,
        plane_min_saving=FORCE if force_planes else 0.05,
    )
    ratio = round_trip(codec, data, dtype, cuts)
    if force_planes and force_entry and nelems:
        assert ratio is not None
    if ratio is not None:
        assert ratio <= (1.0 if force_entry else 0.95)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_multi_frame(pool, dtype):
    for mode in ("mix", "noisy"):
        data = make_bytes(dtype, 5000, seed=1, mode=mode)
        for saving in (FORCE, 0.05):
            codec = BytePlaneCodec(pool, frame_bytes=1024, min_saving=saving, plane_min_saving=saving)
            ratio = round_trip(codec, data, dtype, cuts=[4097, 12_288, 12_289])
            assert saving != FORCE or ratio is not None
    floating = dtype.is_floating_point or dtype.is_complex
    assert plane_width(dtype) == (COMPONENT.get(dtype, dtype).itemsize if floating else 1)


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_split_merge_every_plane_grouping(width):
    n = 1001
    src = np.random.default_rng(width).integers(0, 256, n * width, dtype=np.uint8)
    scratch = np.empty(2 * n, np.uint16)
    for mask in range(1 << width):
        layout = Layout(width, mask, frame_elems=n, nbytes=n * width)
        raw = np.zeros(layout.raw_bytes, np.uint8)
        parts = _raw_parts(layout, raw, 0) + [(j, np.zeros(n, np.uint8)) for j in layout.packed]
        split(src, width, parts)
        for first, part in parts:
            want = src.reshape(n, width)[:, first : first + part.itemsize]
            assert np.array_equal(part.view(np.uint8).reshape(n, -1), want), (mask, first)
        dst = np.zeros_like(src)
        merge(dst, width, parts, scratch)
        assert np.array_equal(dst, src), mask
    assert Layout(4, 0b1000, 1, 4).raw_groups == ((0, 2), (2, 1))
    assert Layout(8, 0b10000000, 1, 8).raw_groups == ((0, 2), (2, 2), (4, 2), (6, 1))
    assert Layout(8, 0b10001010, 1, 8).raw_groups == ((0, 1), (2, 1), (4, 2), (6, 1))


def test_random_bytes_are_stored_raw(pool):
    data = make_bytes(torch.float32, 100_000, seed=2, mode="random")
    assert round_trip(BytePlaneCodec(pool), data, torch.float32, []) is None


def test_legacy_zstd_codec_round_trip(pool):
    data = make_bytes(torch.int32, 50_000, seed=3, mode="mix")

    async def go() -> None:
        codec = ZstdCodec(pool)
        encoded = await codec.encode(data)
        assert encoded is not None and encoded.codec == "zstd"
        out = torch.empty_like(data)
        await codec.decode(encoded.buffer.view[: encoded.nbytes], encoded.meta, split_spans(out, [777]))
        encoded.close()
        assert torch.equal(out, data)

    asyncio.run(go())


def test_cancelled_codec_work_still_finishes_before_returning(pool):
    """Jobs write into buffers the caller frees once run_all returns, even when cancelled."""
    release = threading.Event()
    finished: list[int] = []

    def job(i: int) -> None:
        release.wait(5)
        finished.append(i)

    async def go() -> None:
        task = asyncio.ensure_future(run_all(pool, job, [(0,), (1,), (2,)]))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.sleep(0.05)
        assert not task.done()  # cancelled, but still waiting for its jobs
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert sorted(finished) == [0, 1, 2]

    asyncio.run(go())


# ---------------------------------------------------------------------------- format


def test_meta_layout_and_validation():
    layout = Layout(width=4, mask=0b1000, frame_elems=100, nbytes=4 * 250)
    assert (layout.nframes, layout.packed, layout.raw, layout.raw_bytes) == (3, (3,), (0, 1, 2), 750)
    assert [layout.frame_len(f) for f in range(3)] == [100, 100, 50]
    assert [layout.raw_offset(f) for f in range(3)] == [0, 300, 600]
    meta = encode_meta(layout, [10, 20, (1 << 31) | 50])
    assert len(meta) == HEADER.size + 12
    assert decode_meta(meta, 750 + 80) == (layout, (10, 20, (1 << 31) | 50))
    with pytest.raises(ValueError, match="payload is 829 bytes"):
        decode_meta(meta, 829)
    with pytest.raises(ValueError, match="magic"):
        decode_meta(b"XXXX" + meta[4:], 830)
    with pytest.raises(ValueError, match="shorter"):
        decode_meta(meta[:10], 830)
    with pytest.raises(ValueError, match="expected"):
        decode_meta(meta[:-4], 830)
    with pytest.raises(ValueError, match="stored piece"):
        decode_meta(encode_meta(layout, [10, 20, (1 << 31) | 49]), 829)
    with pytest.raises(ValueError, match="width"):
        Layout(width=3, mask=1, frame_elems=1, nbytes=3)
    with pytest.raises(ValueError, match="whole number"):
        Layout(width=4, mask=1, frame_elems=1, nbytes=6)


def test_codec_arguments(pool):
    with pytest.raises(ValueError, match="frame_bytes"):
        BytePlaneCodec(pool, frame_bytes=12)
    with pytest.raises(TypeError, match="uint8"):
        asyncio.run(BytePlaneCodec(pool).encode(torch.zeros(4), torch.float32))


def test_measure_codec_reports_ratio_and_speed():
    result = measure_codec(synthetic("bf16_weights", 1 * MiB), repeats=1)
    assert result["codec"] == "bplane-zstd" and 0.6 < result["ratio"] < 0.7  # type: ignore[operator]
    assert result["compress_gbps"] > 0 and result["decompress_gbps_per_core"] > 0  # type: ignore[operator]
    raw = measure_codec(make_bytes(torch.uint8, 10_000, 0, "random"), repeats=1)
    assert raw["codec"] == "raw" and raw["ratio"] == 1.0 and raw["decompress_gbps"] is None


# ---------------------------------------------------------------------------- ratios


def ratio_of(pool, tensor: torch.Tensor) -> float:
    data = tensor.contiguous().reshape(-1).view(torch.uint8)
    ratio = round_trip(BytePlaneCodec(pool), data, tensor.dtype, [])
    return 1.0 if ratio is None else ratio


@pytest.mark.parametrize("kind", KINDS)
def test_synthetic_ratio_meets_target(pool, kind):
    tensor = synthetic(kind, 16 * MiB)
    ratio = ratio_of(pool, tensor)
    assert ratio <= TARGETS[kind] + 0.01, (kind, ratio)
    assert ratio >= entropy_floor(tensor) - 0.005  # a sanity check of the floor itself


class TinyGPT(torch.nn.Module):
    """Two pre-norm transformer blocks of width 128 with GPT-2's initialization."""

    def __init__(self, vocab: int = 512, width: int = 128, layers: int = 2, heads: int = 4, context: int = 64) -> None:
        super().__init__()
        self.heads = heads
        self.tok = torch.nn.Embedding(vocab, width)
        self.pos = torch.nn.Embedding(context, width)
        self.blocks = torch.nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(torch.nn.ModuleDict({
                "ln1": torch.nn.LayerNorm(width), "qkv": torch.nn.Linear(width, 3 * width),
                "proj": torch.nn.Linear(width, width), "ln2": torch.nn.LayerNorm(width),
                "up": torch.nn.Linear(width, 4 * width), "down": torch.nn.Linear(4 * width, width),
            }))
        self.ln = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
                torch.nn.init.normal_(m.weight, 0.0, 0.02)
                if getattr(m, "bias", None) is not None:
                    torch.nn.init.zeros_(m.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, t = tokens.shape
        x = self.tok(tokens) + self.pos(torch.arange(t))
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln1"](x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
            x = x + blk["proj"](y)
            x = x + blk["down"](F.gelu(blk["up"](blk["ln2"](x))))
        return self.head(self.ln(x))


def test_trained_states_within_two_points_of_targets(pool):
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    for _ in range(20):
        tokens = torch.randint(0, 512, (8, 65))
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    params = list(model.parameters())
    pooled = lambda ts: torch.cat([t.detach().reshape(-1) for t in ts])  # noqa: E731
    master = pooled(params)
    states = {
        "fp32_master": master,
        "bf16_weights": master.bfloat16(),
        "fp32_upcast_bf16": master.bfloat16().float(),
        "fp32_grad": pooled(p.grad for p in params),
        "adam_exp_avg": pooled(opt.state[p]["exp_avg"] for p in params),
        "adam_exp_avg_sq": pooled(opt.state[p]["exp_avg_sq"] for p in params),
    }
    ratios = {kind: ratio_of(pool, t) for kind, t in states.items()}
    for kind, ratio in ratios.items():
        assert ratio <= TARGETS[kind] + 0.02, ratios


# ---------------------------------------------------------------------------- policy


def test_policy_decisions():
    policy = CompressionPolicy(default=True, mode="auto")
    assert policy.pays() and policy.wants(None)  # nothing measured yet: compress, and measure
    policy.observe_encode(1 << 30, int(0.7 * (1 << 30)), 1.0)
    policy.observe_write(1 << 30, 0.1)  # 10.7 GB/s disk: the codec cannot keep up
    assert policy.estimates.read_bps is None and not policy.pays()  # read and decode assumed alike
    policy.observe_decode(1 << 30, 0.5)
    policy.observe_read(1 << 30, 0.1)
    assert math.isclose(policy.estimates.ratio, 0.7, rel_tol=1e-6)
    policy.observe_encode(1 << 30, 1 << 30, 0.0)  # stored raw: counts for the ratio only
    keep = math.exp(-2)  # 1 GiB later, an old measurement weighs exp(-1 GiB / 512 MiB)
    assert math.isclose(policy.estimates.ratio, (0.7 * keep + 1) / (keep + 1), rel_tol=1e-6)
    assert math.isclose(policy.estimates.encode_bps, (1 << 30) / 1.0, rel_tol=1e-6)
    assert not policy.wants(None) and policy.skipped == 1
    assert policy.wants(True) and not policy.wants(False)
    policy.observe_write(8 << 30, 800.0)  # now mostly a very slow disk: even a 4% saving pays
    policy.observe_read(8 << 30, 800.0)
    assert policy.wants(None)
    assert CompressionPolicy(default=True, mode="always").wants(None)
    assert not CompressionPolicy(default=False, mode="always").wants(None)
    with pytest.raises(ValueError, match="'sometimes'"):
        CompressionPolicy(default=True, mode="sometimes")


def test_config_validates_compress_policy(tmp_path):
    with pytest.raises(ValueError, match=r"compress_policy.*'sometimes'"):
        tiered.StoreConfig(path=str(tmp_path), compress_policy="sometimes")
    assert tiered.StoreConfig(path=str(tmp_path), compress_policy="always").compress_policy == "always"


# ---------------------------------------------------------------------------- the store


def weights(nbytes: int, seed: int = 0) -> torch.Tensor:
    return synthetic("fp32_master", nbytes, seed).reshape(-1, 16)


async def test_put_compressed_records_codec_and_reopens(config):
    x, y = weights(600 * KiB), synthetic("bf16_weights", 300 * KiB, 1)
    ints = torch.arange(40_000, dtype=torch.int64) % 7
    async with await tiered.TieredStore.open_async(config) as store:
        await store.put("w", x, compress=True)
        await store.put("b", y, tier="host", compress=True)
        await store.put("i", ints, compress=True)
        await store.put("r", x, compress=False)
        info = store.info("w")
        assert info.codec == "bplane-zstd" and info.stored_nbytes < 0.85 * info.nbytes
        assert store.info("i").codec == "bplane-zstd" and store.info("i").stored_nbytes < 0.2 * ints.numel() * 8
        assert store.info("r").codec == "raw" and store.info("r").stored_nbytes == info.nbytes
        await store.evict("b", "nvme")  # written down under the put's request
        assert store.info("b").codec == "bplane-zstd"
        stats = store.stats()
        assert stats.bytes_before_codec == 2 * info.nbytes + y.numel() * 2 + ints.numel() * 8
        stored = sum(store.info(k).stored_nbytes for k in ("w", "b", "i", "r"))
        assert stats.bytes_after_codec == stored < stats.bytes_before_codec
        assert stats.codec_encode_bps and stats.nvme_write_bps and 0 < stats.codec_ratio < 1
        assert same_bytes(await store.get("w"), x)
        assert stats.as_dict()["codec_ratio"] == stats.codec_ratio
    async with await tiered.TieredStore.open_async(config) as store:
        assert store.info("w").codec == "bplane-zstd" and store.info("w").stored_nbytes == info.stored_nbytes
        for key, want in (("w", x), ("b", y), ("i", ints), ("r", x)):
            assert same_bytes(await store.get(key), want)
        assert store.stats().codec_decode_bps and store.stats().nvme_read_bps


async def test_old_zstd_entries_still_read(config):
    x = weights(200 * KiB)
    async with await tiered.TieredStore.open_async(config) as store:
        store._codec.writer = ZstdCodec(store._cpu_pool)  # what the previous version wrote
        await store.put("old", x, compress=True)
        assert store.info("old").codec == "zstd"
    async with await tiered.TieredStore.open_async(config) as store:
        assert store.info("old").codec == "zstd"
        assert same_bytes(await store.get("old"), x)


def inject(store: tiered.TieredStore, disk_gbps: float, codec_gbps: float, ratio: float = 0.8) -> None:
    """Make the store's estimates say so, with enough bytes to outweigh the test's own transfers."""
    n = 64 << 30
    policy = store._compression
    policy.observe_encode(n, int(ratio * n), n / (codec_gbps * 1e9))
    policy.observe_decode(n, n / (codec_gbps * 1e9))
    policy.observe_write(n, n / (disk_gbps * 1e9))
    policy.observe_read(n, n / (disk_gbps * 1e9))


async def test_auto_policy_skips_when_the_disk_outruns_the_codec(config):
    x = weights(256 * KiB)
    async with await tiered.TieredStore.open_async(config.replace(compress=True)) as store:
        assert store.config.compress_policy == "auto"
        await store.put("first", x)  # nothing measured yet: compresses, and measures
        assert store.info("first").codec == "bplane-zstd"
        inject(store, disk_gbps=20.0, codec_gbps=1.0)
        await store.put("fast-disk", x)
        assert store.info("fast-disk").codec == "raw" and store.stats().compress_skipped == 1
        await store.put("capacity", x, compress=True)  # asked for: always compressed
        assert store.info("capacity").codec == "bplane-zstd"
        await store.put("host", x, tier="host")  # decided when written down, with the same rule
        await store.evict("host", "nvme")
        assert store.info("host").codec == "raw" and store.stats().compress_skipped == 2
        inject(store, disk_gbps=0.05, codec_gbps=1.0)
        await store.put("slow-disk", x)
        assert store.info("slow-disk").codec == "bplane-zstd"
        for key in ("first", "fast-disk", "capacity", "host", "slow-disk"):
            assert same_bytes(await store.get(key), x)


async def test_always_policy_and_default_off(config):
    x = weights(256 * KiB)
    async with await tiered.TieredStore.open_async(config.replace(compress=True, compress_policy="always")) as store:
        inject(store, disk_gbps=20.0, codec_gbps=1.0)
        await store.put("k", x)
        assert store.info("k").codec == "bplane-zstd" and store.stats().compress_skipped == 0
    async with await tiered.TieredStore.open_async(config) as store:  # compress=False by default
        await store.put("k2", x)
        assert store.info("k2").codec == "raw"
        with pytest.raises(TypeError, match="compress"):
            await store.put("k3", x, compress="yes")
