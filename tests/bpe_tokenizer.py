"""A byte-level BPE tokenizer (as GPT-2's, Llama 3's, Qwen's), trained at once on a little text:
the kind of tokenizer `make_detokenizer` gives DecodeStream (`StreamDetokenizer`)."""

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from jaxserve.text.tokenizer import Tokenizer

MIXED_TEXT = "Héllo wörld 😀 naïve café, 日本語のテキスト 🎉🧠 Ωμέγα ﬁn."


def byte_level_bpe_hf() -> HFTokenizer:
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    hf.train_from_iterator([MIXED_TEXT, "Once upon a time there was a little girl named Lily."]
                           * 20, trainer)
    return hf


def byte_level_bpe() -> Tokenizer:
    return Tokenizer(byte_level_bpe_hf(), {"bos_token": "<s>", "eos_token": "</s>"})
