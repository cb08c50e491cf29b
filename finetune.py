"""Fine-tune and evaluate BERT: ``python finetune.py [task=...] [key=value ...] [-m]``.

Examples:
    python finetune.py                                    # built-in toy task, tiny model, no download
    python finetune.py task=toy_squad                     # toy span extraction (SQuAD format)
    python finetune.py task=mnli task.data_dir=glue/MNLI vocab=vocab.txt model=bert-base \
        init.checkpoint='[ckpt/stage0.pt,ckpt/stage1.pt]'
    python finetune.py task=squad_v1 task.data_dir=squad vocab=vocab.txt init.checkpoint='[bert.pt]'
"""

from pipefisher.finetune.cli import finetune_main

if __name__ == "__main__":
    finetune_main()
