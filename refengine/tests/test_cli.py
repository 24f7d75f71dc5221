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
