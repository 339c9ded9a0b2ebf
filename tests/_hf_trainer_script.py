"""A Hugging Face Trainer script in the shape of transformers' examples (run_clm.py): TrainingArguments from the
command line, so Apex is chosen with ``--fp16 --half_precision_backend apex --fp16_opt_level O1|O2``.

A tiny randomly initialised GPT-2 (tied input/output embeddings unless --untied) learns a few fixed token
sequences. Prints whether transformers saw apex, the logged losses, and a digest of the final state_dict.
Run by tests/integration/test_real_apex_scripts.py under ``amp-patch run``.
"""
import dataclasses
import hashlib

import torch
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer, TrainingArguments
from transformers.utils.import_utils import is_apex_available


@dataclasses.dataclass
class ModelArguments:
    untied: bool = dataclasses.field(default=False, metadata={"help": "untie the input/output embeddings"})
    resume_from: str = dataclasses.field(default=None, metadata={"help": "a checkpoint-N directory"})
    train_twice: bool = dataclasses.field(default=False, metadata={"help": "call trainer.train() a second time"})


class Sequences(torch.utils.data.Dataset):
    def __init__(self, n=8, length=8, vocab=64):
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main():
    model_args, args = HfArgumentParser((ModelArguments, TrainingArguments)).parse_args_into_dataclasses()
    print("apex available", is_apex_available(), "backend", args.half_precision_backend, args.fp16_opt_level)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                        tie_word_embeddings=not model_args.untied)
    model = GPT2LMHeadModel(config)
    trainer = Trainer(model=model, args=args, train_dataset=Sequences())
    trainer.train(resume_from_checkpoint=model_args.resume_from)
    if model_args.train_twice:  # the Trainer calls amp.initialize again, on the same model (and a fresh state)
        print("first losses", [log["loss"] for log in trainer.state.log_history if "loss" in log])
        trainer.train()
    print("optimizer", type(trainer.optimizer).__module__, type(trainer.optimizer).__name__)
    print("losses", [log["loss"] for log in trainer.state.log_history if "loss" in log])
    state = trainer.model.state_dict()
    print("embedding dtypes", state["transformer.wte.weight"].dtype, state["lm_head.weight"].dtype)
    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(name.encode() + state[name].float().numpy().tobytes())
    print("digest", digest.hexdigest())


if __name__ == "__main__":
    main()
