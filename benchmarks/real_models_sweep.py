"""Which real models transform, and match eager? A sweep beyond the test suite.

Tiny random-weight transformers 5.x models and timm models; for each: data parallel on 4 virtual
CPU devices (eval on batches of 8 and 7, training loss and every gradient on a batch of 7) and
tensor parallel on 2 (eval). Prints one line per model and writes
``benchmarks/results/real_models_sweep.json``.

    python benchmarks/real_models_sweep.py gpt2 bert llama t5 distilbert roberta albert electra \
        mistral qwen2 opt gpt_neox bart gemma vit_hf timm:resnet18 timm:vit_small_patch16_224

float32 gradients of deep BatchNorm CNNs on tiny batches differ by rounding (equal in float64);
models with stochastic training (timm swin's DropPath) cannot match eager in training.
"""

import copy
import json
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.thirdparty import define_torchvision_ops  # noqa: E402

define_torchvision_ops()
warnings.simplefilter("ignore")
import timm  # noqa: E402
import transformers as T  # noqa: E402

import dpcompile  # noqa: E402

T.logging.set_verbosity_error()
V = 128


def hf(name):
    common = dict(vocab_size=V, max_position_embeddings=32)
    if name == "roberta":
        return T.RobertaForSequenceClassification(
            T.RobertaConfig(
                num_hidden_layers=2,
                hidden_size=32,
                num_attention_heads=4,
                intermediate_size=64,
                hidden_dropout_prob=0,
                attention_probs_dropout_prob=0,
                pad_token_id=1,
                **common,
            )
        ), "cls"
    if name == "albert":
        return T.AlbertForSequenceClassification(
            T.AlbertConfig(
                num_hidden_layers=2,
                hidden_size=32,
                embedding_size=16,
                num_attention_heads=4,
                intermediate_size=64,
                hidden_dropout_prob=0,
                attention_probs_dropout_prob=0,
                classifier_dropout_prob=0,
                **common,
            )
        ), "cls"
    if name == "electra":
        return T.ElectraForSequenceClassification(
            T.ElectraConfig(
                num_hidden_layers=2,
                hidden_size=32,
                embedding_size=16,
                num_attention_heads=4,
                intermediate_size=64,
                hidden_dropout_prob=0,
                attention_probs_dropout_prob=0,
                **common,
            )
        ), "cls"
    if name == "mistral":
        return T.MistralForCausalLM(
            T.MistralConfig(
                num_hidden_layers=2,
                hidden_size=32,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=64,
                use_cache=False,
                **common,
            )
        ), "lm"
    if name == "qwen2":
        return T.Qwen2ForCausalLM(
            T.Qwen2Config(
                num_hidden_layers=2,
                hidden_size=32,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=64,
                use_cache=False,
                **common,
            )
        ), "lm"
    if name == "opt":
        return T.OPTForCausalLM(
            T.OPTConfig(
                num_hidden_layers=2,
                hidden_size=32,
                num_attention_heads=4,
                ffn_dim=64,
                word_embed_proj_dim=32,
                dropout=0,
                attention_dropout=0,
                use_cache=False,
                **common,
            )
        ), "lm"
    if name == "gpt_neox":
        return T.GPTNeoXForCausalLM(
            T.GPTNeoXConfig(
                num_hidden_layers=2,
                hidden_size=32,
                num_attention_heads=4,
                intermediate_size=64,
                use_cache=False,
                hidden_dropout=0,
                attention_dropout=0,
                **common,
            )
        ), "lm"
    if name == "bart":
        return T.BartForConditionalGeneration(
            T.BartConfig(
                encoder_layers=1,
                decoder_layers=1,
                d_model=32,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=64,
                decoder_ffn_dim=64,
                dropout=0,
                attention_dropout=0,
                activation_dropout=0,
                use_cache=False,
                **common,
            )
        ), "seq2seq"
    if name == "gemma":
        return T.GemmaForCausalLM(
            T.GemmaConfig(
                num_hidden_layers=2,
                hidden_size=32,
                num_attention_heads=4,
                num_key_value_heads=1,
                head_dim=8,
                intermediate_size=64,
                use_cache=False,
                **common,
            )
        ), "lm"
    if name == "vit_hf":
        return T.ViTForImageClassification(
            T.ViTConfig(
                num_hidden_layers=2,
                hidden_size=32,
                num_attention_heads=4,
                intermediate_size=64,
                image_size=32,
                patch_size=8,
                num_labels=3,
                hidden_dropout_prob=0,
                attention_probs_dropout_prob=0,
            )
        ), "img"
    if name == "gpt2":
        return T.GPT2LMHeadModel(
            T.GPT2Config(
                n_layer=2,
                n_embd=32,
                n_head=4,
                vocab_size=V,
                n_positions=32,
                resid_pdrop=0,
                embd_pdrop=0,
                attn_pdrop=0,
                use_cache=False,
            )
        ), "lm"
    if name == "bert":
        return T.BertForSequenceClassification(
            T.BertConfig(
                num_hidden_layers=2,
                hidden_size=32,
                num_attention_heads=4,
                intermediate_size=64,
                hidden_dropout_prob=0,
                attention_probs_dropout_prob=0,
                **common,
            )
        ), "cls"
    if name == "llama":
        return T.LlamaForCausalLM(
            T.LlamaConfig(
                num_hidden_layers=2,
                hidden_size=32,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=64,
                use_cache=False,
                **common,
            )
        ), "lm"
    if name == "t5":
        return T.T5ForConditionalGeneration(
            T.T5Config(
                num_layers=1,
                num_decoder_layers=1,
                d_model=32,
                d_kv=8,
                num_heads=4,
                d_ff=64,
                vocab_size=V,
                dropout_rate=0,
                use_cache=False,
                decoder_start_token_id=0,
                pad_token_id=0,
            )
        ), "seq2seq"
    if name == "distilbert":
        return T.DistilBertForSequenceClassification(
            T.DistilBertConfig(
                n_layers=2,
                dim=32,
                n_heads=4,
                hidden_dim=64,
                dropout=0,
                attention_dropout=0,
                seq_classif_dropout=0,
                **common,
            )
        ), "cls"
    raise KeyError


def inputs(kind, b, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "img":
        return (
            (),
            {"pixel_values": torch.randn(b, 3, 32, 32, generator=g), "labels": torch.randint(0, 3, (b,), generator=g)},
        )
    if kind.startswith("timm"):
        return ((torch.randn(b, 3, 32, 32, generator=g),), {})
    ids = torch.randint(2, V, (b, 10), generator=g)
    mask = torch.ones(b, 10, dtype=torch.long)
    mask[0, 7:] = 0
    kw = {"input_ids": ids, "attention_mask": mask}
    if kind == "cls":
        kw["labels"] = torch.randint(0, 2, (b,), generator=g)
    elif kind == "lm":
        kw["labels"] = torch.randint(0, V, (b, 10), generator=g)
    else:
        kw["decoder_input_ids"] = torch.randint(2, V, (b, 6), generator=g)
        kw["labels"] = torch.randint(0, V, (b, 6), generator=g)
    return ((), kw)


def loss_of(out):
    if hasattr(out, "loss") and out.loss is not None:
        return out.loss
    return (out * torch.linspace(0.5, 1.5, out.numel()).view(out.shape)).sum()


def logits(out):
    return out.logits if hasattr(out, "logits") else out


results = {}
for name in sys.argv[1:]:
    t0 = time.time()
    res = {}
    try:
        torch.manual_seed(0)
        if name.startswith("timm:"):
            m = timm.create_model(
                name[5:],
                pretrained=False,
                num_classes=5,
                **({"img_size": 32} if any(k in name for k in ("vit", "swin", "deit", "beit")) else {}),
            )
            kind = "timm"
        else:
            m, kind = hf(name)
        m.eval()
        ref = copy.deepcopy(m)
        a, kw = inputs(kind, 4, 0)
        pm = dpcompile.transform(m, ["cpu"] * 4, example_inputs=a or None, example_kwargs=kw or None)
        for b in (8, 7):
            a, kw = inputs(kind, b, b)
            torch.testing.assert_close(logits(pm(*a, **kw)), logits(ref(*a, **kw)), atol=3e-5, rtol=1e-4)
        res["eval+uneven"] = "ok"
        pm.train()
        ref.train()
        a, kw = inputs(kind, 7, 3)
        l1 = loss_of(pm(*a, **kw))
        l2 = loss_of(ref(*a, **kw))
        torch.testing.assert_close(l1, l2, atol=3e-5, rtol=1e-4)
        l1.backward()
        l2.backward()
        ours = dict(m.named_parameters())
        for n, p in ref.named_parameters():
            if p.grad is not None:
                torch.testing.assert_close(ours[n].grad, p.grad, atol=5e-5, rtol=1e-3, msg=lambda s, n=n: f"{n}: {s}")
        res["train"] = "ok"
    except Exception as e:
        res["dp"] = f"FAIL {type(e).__name__}: {str(e)[:300]}"
    try:
        m2 = copy.deepcopy(ref).eval()
        a, kw = inputs(kind, 4, 0)
        tp = dpcompile.transform(
            m2, ["cpu"] * 2, tensor_parallel=True, example_inputs=a or None, example_kwargs=kw or None
        )
        torch.testing.assert_close(logits(tp(*a, **kw)), logits(m2(*a, **kw)), atol=3e-5, rtol=1e-4)
        res["tp"] = f"ok ({sum(s != 'replicate' for s in tp.plan.values())} sharded)"
    except Exception as e:
        res["tp"] = f"FAIL {type(e).__name__}: {str(e)[:300]}"
    print(name, f"{time.time() - t0:.1f}s", res, flush=True)
    results[name] = res
out = Path(__file__).parent / "results" / "real_models_sweep.json"
out.parent.mkdir(parents=True, exist_ok=True)
out.write_text(json.dumps(results, indent=2) + "\n")
