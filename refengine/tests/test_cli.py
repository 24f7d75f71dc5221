"""``python -m pagedbench.refengine generate``: a named random config runs end to end in a subprocess (no
download), completions equal ``LLM.generate``'s, a folder's tokenizer and chat template are used, and a
mistake on the command line is one clear line on stderr with exit status 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from pagedbench.refengine import LLM, ModelConfig, SamplingParams, load_model
from pagedbench.refengine.cli import chat_prompt, main, named_configs_path

HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 16, "hidden_size": 16,
             "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
             "max_position_embeddings": 64, "torch_dtype": "float32"}
VOCAB = {"[UNK]": 0, "BOS": 1, "USER": 2, "ASSISTANT": 3, "hello": 4, "world": 5}
TEMPLATE = ("{{ bos_token }} {% for m in messages %}{{ m['role'] | upper }} {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}ASSISTANT{% endif %}")


def tiny_greedy(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    llm = LLM(ModelConfig.from_yaml(named_configs_path(), name="tiny"), seed=0)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_named_config_in_a_subprocess():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pagedbench.refengine", "generate", "--model", "tiny", "--prompt-ids", "1,2,3",
         "--prompt-ids", "4, 5", "--max-tokens", "4", "--seed", "0"],
        capture_output=True, text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    first, second = tiny_greedy([[1, 2, 3], [4, 5]], 4)
    lines = proc.stdout.splitlines()
    assert lines[:4] == ["[0] ids [1, 2, 3]", f"    -> ids {first} (length)", "[1] ids [4, 5]",
                         f"    -> ids {second} (length)"]
    assert lines[4].startswith("stats: 2 requests, 5 prompt tokens, 8 generated tokens in ")
    assert "output " in lines[4] and "tok/s" in lines[4]
    err = proc.stderr.splitlines()  # progress: no bar for two prompts off a terminal, the loading lines
    assert err[0] == "loading tiny ..." and err[1].startswith("loaded in ") and len(err) == 2


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A Hugging Face folder: config.json, safetensors, a word-level tokenizer and a chat template."""
    tokenizers = pytest.importorskip("tokenizers")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    path = tmp_path_factory.mktemp("hf")
    (path / "config.json").write_text(json.dumps(HF_CONFIG))
    model = load_model(ModelConfig.from_hf_dict(HF_CONFIG), attention_backend="torch", seed=3).model
    safetensors_torch.save_file(model.state_dict(), str(path / "model.safetensors"))
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "bos_token": "BOS"}))
    return path


def test_text_prompt_uses_the_folders_tokenizer(folder, capsys):
    assert main(["generate", "--model", str(folder), "--prompt", "hello world", "--max-tokens", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "[0] 'hello world'" and out[1].startswith("    -> '") and out[1].endswith("(length)")
    assert out[2].startswith("stats: 1 requests, 2 prompt tokens, 3 generated tokens")


def test_chat_wraps_the_prompt_in_the_template(folder, capsys):
    assert main(["generate", "--model", str(folder), "--prompt", "hello world", "--chat", "--max-tokens", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "[0] 'hello world' (chat, 5 tokens)"
    tokenizer = load_model(str(folder)).tokenizer
    assert chat_prompt(str(folder), tokenizer, "hello world") == {"prompt_token_ids": [1, 2, 4, 5, 3]}  # BOS USER
    # hello world ASSISTANT


def test_chat_without_a_template_is_an_error(folder, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (bare / name).symlink_to(folder / name)
    assert main(["generate", "--model", str(bare), "--prompt", "hello", "--chat"]) == 2
    assert f"{bare} has no chat template (neither chat_template.jinja nor a chat_template in " \
           "tokenizer_config.json)" in capsys.readouterr().err


def test_chat_on_the_layout_make_model_writes(folder, tmp_path, capsys):
    """The template in chat_template.jinja, tokenizer_config.json without one (recent transformers)."""
    made = tmp_path / "made"
    made.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (made / name).symlink_to(folder / name)
    (made / "tokenizer_config.json").write_text(json.dumps({"bos_token": "BOS", "eos_token": "[UNK]"}))
    (made / "chat_template.jinja").write_text(TEMPLATE)
    assert main(["generate", "--model", str(made), "--prompt", "hello world", "--chat", "--max-tokens", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "[0] 'hello world' (chat, 5 tokens)"
    tokenizer = load_model(str(made)).tokenizer
    assert chat_prompt(str(made), tokenizer, "hello world") == {"prompt_token_ids": [1, 2, 4, 5, 3]}


@pytest.mark.parametrize(("argv", "message"), [
    (["--max-tokens", "-1"], "max_tokens must be an int >= 1, got -1"),
    (["--top-p", "0"], "top_p"),
    (["--temperature", "-1"], "temperature"),
    (["--seed", "-3"], "--seed must be >= 0; got -3"),
])
def test_arguments_are_checked_before_the_model_loads(folder, monkeypatch, capsys, argv, message):
    from pagedbench.refengine.engine import llm as llm_module

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(llm_module.LLM, "__init__", never)
    assert main(["generate", "--model", str(folder), "--prompt", "hello", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_help_is_plain_and_imports_no_torch():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    code = ("import sys\nfrom pagedbench.refengine.cli import main\ntry:\n    main(['generate', '--help'])\n"
            "except SystemExit:\n    pass\nprint('torch imported' if 'torch' in sys.modules else 'no torch')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60,
                          check=True)
    assert proc.stdout.rstrip().endswith("no torch")
    assert "--max-tokens" in proc.stdout and "``" not in proc.stdout and ":mod:" not in proc.stdout


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "/no/such/folder", "--prompt-ids", "1"],
     "--model '/no/such/folder': no such model folder or .yaml config, and not a named config; named configs: "),
    (["--model", "tiny", "--prompt", "hi"], "--model 'tiny' has no tokenizer: pass token ids with --prompt-ids"),
    (["--model", "tiny"], "give at least one --prompt TEXT or --prompt-ids 1,2,3"),
    (["--model", "tiny", "--prompt-ids", "1", "--max-tokens", "0"], "max_tokens must be an int >= 1, got 0"),
    (["--model", "tiny", "--prompt-ids", "1", "--chat"], "--chat needs a model folder with a chat template"),
])
def test_mistakes_are_one_clear_line(argv, message, capsys):
    assert main(["generate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1 and "Traceback" not in err


def test_named_configs_are_listed_in_the_missing_model_error(capsys):
    main(["generate", "--model", "nope", "--prompt-ids", "1"])
    assert "tiny" in capsys.readouterr().err.split("named configs: ")[1].strip().split(", ")


def test_bad_token_ids_are_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", "tiny", "--prompt-ids", "1,x"])
    assert e.value.code == 2 and "expected comma-separated token ids like 1,2,3; got '1,x'" in capsys.readouterr().err


def test_a_rejected_prompt_is_printed_and_exits_1(capsys):
    assert main(["generate", "--model", "tiny", "--prompt-ids", "1", "--prompt-ids", "99999"]) == 1
    out = capsys.readouterr().out
    assert "[1] ids [99999]\n    error: token ids outside the vocabulary [0, 512)" in out


def test_sampling_options_reach_the_engine(capsys):
    """--temperature, --top-p and --seed give what LLM.generate gives with the same settings."""
    argv = ["generate", "--model", "tiny", "--prompt-ids", "7,8", "--max-tokens", "6"]
    assert main([*argv, "--temperature", "1.5", "--top-p", "0.9", "--seed", "5"]) == 0
    llm = LLM(ModelConfig.from_yaml(named_configs_path(), name="tiny"), seed=5)
    params = SamplingParams(max_tokens=6, temperature=1.5, top_p=0.9)
    expected = llm.generate([[7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids
    greedy = tiny_greedy([[7, 8]], 6)[0]
    assert expected != greedy  # the settings matter for this prompt
    assert capsys.readouterr().out.splitlines()[1] == f"    -> ids {expected} (length)"


def test_serve_says_where_it_is_ready(tmp_path):
    pytest.importorskip("uvicorn")
    import os
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONSAFEPATH": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pagedbench.refengine", "serve", "--model", "tiny",
                             "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        deadline = time.monotonic() + 90
        line = ""
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line or line.startswith("ready on"):
                break
        assert line.strip() == f"ready on http://127.0.0.1:{port} (model 'tiny'; Ctrl-C stops)"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_stats_line_says_when_the_machine_is_loaded():
    from pagedbench.refengine.cli import format_stats

    llm = LLM(ModelConfig.from_yaml(named_configs_path(), name="tiny"), seed=0)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    busy = format_stats(llm.stats, load=(5.2, 2))
    assert busy.endswith("[machine loaded: load average 5.2 on 2 cores; other work shares them, so these rates "
                         "read low]")
    idle = format_stats(llm.stats, load=(1.5, 2))
    assert idle.endswith("tok/s") and busy.startswith(idle)


class Captured(Exception):
    """Raised in place of building the LLM: its keyword arguments are in ``args[0]``."""


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_the_kv_memory_flags_reach_the_engine(command, monkeypatch):
    if command == "serve":
        pytest.importorskip("uvicorn")
    from pagedbench.refengine.engine import llm as llm_module

    def capture(self, model, **kwargs):
        raise Captured(kwargs)
    monkeypatch.setattr(llm_module.LLM, "__init__", capture)
    prompt = ["--prompt-ids", "1"] if command == "generate" else []
    argv = [command, "--model", "tiny", *prompt, "--num-blocks", "7", "--preemption-mode", "swap",
            "--swap-space", "0.5", "--kv-offloading-size", "0.25"]
    with pytest.raises(Captured) as e:
        main(argv)
    got = e.value.args[0]
    assert {k: got[k] for k in ("num_blocks", "preemption_mode", "swap_space", "kv_offloading_size")} == \
        {"num_blocks": 7, "preemption_mode": "swap", "swap_space": 0.5, "kv_offloading_size": 0.25}
    with pytest.raises(Captured) as e:
        main([command, "--model", "tiny", *prompt])
    defaults = e.value.args[0]  # the engine's and vLLM's defaults
    assert (defaults["preemption_mode"], defaults["swap_space"], defaults["kv_offloading_size"]) == ("recompute", 4, 0)
    if command == "generate":
        assert got["enable_prefix_caching"] is True and defaults["num_blocks"] is None
        with pytest.raises(Captured) as e:
            main([*argv[:-2], "--no-enable-prefix-caching"])
        assert e.value.args[0]["enable_prefix_caching"] is False


def tiny_prompts(*lengths: int) -> list[list[int]]:
    return [[(7 * i + 3 * k + 1) % 512 for i in range(n)] for k, n in enumerate(lengths)]


def test_a_small_pool_with_swap_prints_its_swaps_and_keeps_the_tokens(capsys):
    """Two sequences that cannot both fit 5 blocks: swap mode swaps one out and back, recompute recomputes it;
    the completions are those of a pool that fits both."""
    prompts = [["--prompt-ids", ",".join(map(str, p))] for p in tiny_prompts(3, 3)]
    argv = ["generate", "--model", "tiny", *prompts[0], *prompts[1], "--max-tokens", "40"]
    assert main(argv) == 0
    roomy = capsys.readouterr().out.splitlines()
    assert "preemptions" not in roomy[-1] and "swaps" not in roomy[-1]
    assert main([*argv, "--num-blocks", "5", "--preemption-mode", "swap"]) == 0
    swapped = capsys.readouterr().out.splitlines()
    assert swapped[:-1] == roomy[:-1]
    assert "; 1 preemptions; swaps: 1 groups out (2 blocks), 1 in" in swapped[-1]
    assert main([*argv, "--num-blocks", "5"]) == 0
    recomputed = capsys.readouterr().out.splitlines()
    assert recomputed[:-1] == roomy[:-1] and "; 1 preemptions" in recomputed[-1] and "swaps" not in recomputed[-1]


def test_a_repeated_prompt_is_loaded_from_the_host_tier(capsys):
    """The first prompt's cached blocks are evicted by the second's; the third repeats the first and loads
    them from the host tier: the line reports the engine's own counts for the same settings."""
    prompts = tiny_prompts(40, 70)
    prompts.append(prompts[0])
    argv = ["generate", "--model", "tiny", *[a for p in prompts for a in ("--prompt-ids", ",".join(map(str, p)))],
            "--max-tokens", "4", "--num-blocks", "6"]
    assert main([*argv, "--kv-offloading-size", "0.01"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    llm = LLM(ModelConfig.from_yaml(named_configs_path(), name="tiny"), seed=0, num_blocks=6, kv_offloading_size=0.01)
    llm.generate(prompts, SamplingParams(max_tokens=4), use_tqdm=False)
    st = llm.stats
    assert st.prefix_host_hit_tokens > 0 and st.num_host_blocks == int(0.01 * 2**30) // llm.pool.bytes_per_block
    assert (f"; host tier of {st.num_host_blocks} blocks: {st.prefix_host_hit_tokens} prompt tokens loaded, "
            f"{st.num_offloaded_blocks} blocks stored") in line


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize(("argv", "message"), [
    (["--swap-space", "-1"], "swap_space must be a finite number of GiB >= 0, got -1.0"),
    (["--swap-space", "nan", "--preemption-mode", "swap"], "swap_space must be a finite number of GiB >= 0, got nan"),
    (["--kv-offloading-size", "-0.5"], "kv_offloading_size must be a finite number of GiB >= 0, got -0.5"),
    (["--kv-offloading-size", "inf"], "kv_offloading_size must be a finite number of GiB >= 0, got inf"),
    (["--preemption-mode", "swap"], "swap_space=4 GiB needs 4,294,967,296 bytes of host memory but only "
                                    "3,221,225,472 bytes are available"),
    (["--preemption-mode", "swap", "--swap-space", "2", "--kv-offloading-size", "2"],
     "kv_offloading_size=2.0 GiB needs 2,147,483,648 bytes of host memory (beside swap_space's 2,147,483,648) but "
     "only 3,221,225,472 bytes are available"),
    (["--preemption-mode", "swap", "--tensor-parallel-size", "2"],
     "preemption_mode='swap' is not supported with tensor_parallel_size > 1 yet"),
    (["--kv-offloading-size", "1", "--tensor-parallel-size", "2"],
     "kv_offloading_size is not supported with tensor_parallel_size > 1 yet"),
    (["--num-blocks", "0"], "--num-blocks must be >= 1; got 0"),
], ids=["swap-negative", "swap-nan", "offload-negative", "offload-inf", "swap-too-large", "both-too-large",
        "swap-tp", "offload-tp", "no-blocks"])
def test_bad_kv_memory_flags_are_refused_before_the_model_loads(command, argv, message, monkeypatch, capsys):
    if command == "serve":
        pytest.importorskip("uvicorn")
    from pagedbench.refengine.engine import host_memory_arguments
    from pagedbench.refengine.engine import llm as llm_module

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")
    monkeypatch.setattr(llm_module.LLM, "__init__", never)
    monkeypatch.setattr(host_memory_arguments, "available_host_memory_bytes", lambda: 3 * 2**30)  # a small host
    prompt = ["--prompt-ids", "1"] if command == "generate" else []
    assert main([command, "--model", "tiny", *prompt, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err


def test_the_host_tier_needs_prefix_caching_on_the_command_line(capsys):
    assert main(["generate", "--model", "tiny", "--prompt-ids", "1", "--kv-offloading-size", "1",
                 "--no-enable-prefix-caching"]) == 2
    assert "kv_offloading_size=1.0 is a host tier of the prefix cache: it needs the paged allocator with " \
           "enable_prefix_caching=True, got allocator='paged', enable_prefix_caching=False" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["abc", ""])
def test_a_non_numeric_size_is_an_argparse_error(value, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", "tiny", "--prompt-ids", "1", "--swap-space", value])
    assert e.value.code == 2 and f"argument --swap-space: invalid float value: '{value}'" in capsys.readouterr().err
