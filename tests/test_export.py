"""An exported model directory works on its own: a fresh process that imports only `transformers` loads
it with the Auto* classes, the model config, generation config and tokenizer agree that EOS and BOS are
GPT-2's <|endoftext|> (50256, not LlamaConfig's defaults 1 and 2, which decode to '"' and '#'), and
greedy `generate` produces new tokens."""

import json
import subprocess
import sys

from ray_diloco.model import build_model, padded_vocab_size, parameter_state, save_model
from ray_diloco.presets import tiny_cpu
from ray_diloco.tokenizer import load_tokenizer

CHECK = r"""
import json, sys
from transformers import AutoModelForCausalLM, AutoTokenizer
assert not any(m.startswith("ray_diloco") for m in sys.modules), "the export must not need ray_diloco"
directory = sys.argv[1]
tok = AutoTokenizer.from_pretrained(directory)
model = AutoModelForCausalLM.from_pretrained(directory)
prompt = tok("Hello", return_tensors="pt")
out = model.generate(**prompt, max_new_tokens=5, do_sample=False)
print(json.dumps({
    "config": [model.config.eos_token_id, model.config.bos_token_id, model.config.pad_token_id],
    "generation": [model.generation_config.eos_token_id, model.generation_config.bos_token_id,
                   model.generation_config.pad_token_id],
    "tokenizer": [tok.eos_token_id, tok.bos_token_id, tok.pad_token_id],
    "prompt_len": prompt["input_ids"].shape[1], "out_len": out.shape[1],
}))
"""


def test_exported_model_loads_and_generates_with_gpt2_special_tokens(tmp_path):
    tokenizer = load_tokenizer(None)
    cfg = tiny_cpu()
    model = build_model(cfg.model, padded_vocab_size(cfg.model, len(tokenizer)), cfg.data.seq_len, cfg.run.seed)
    save_model(model, parameter_state(model), tmp_path, tokenizer)

    done = subprocess.run([sys.executable, "-c", CHECK, str(tmp_path)], capture_output=True, text=True, timeout=300,
                          check=False)  # the assert below shows its stderr
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    eos = 50256
    assert seen["tokenizer"][:2] == [eos, eos]  # GPT-2 uses <|endoftext|> as both BOS and EOS
    assert seen["config"][:2] == [eos, eos]
    assert seen["generation"][:2] == [eos, eos]
    # No pad token of its own: pad is EOS everywhere, so generate has one and does not warn.
    assert seen["config"][2] == seen["generation"][2] == seen["tokenizer"][2] == eos
    assert seen["out_len"] > seen["prompt_len"]
