"""Pretrain BERT: ``python train.py [group=option ...] [key=value ...] [-m]``.

Examples:
    python train.py                                          # bert-tiny, synthetic data, one process
    python train.py pipeline=chimera stages=4 model=bert-mini num_micro_batches=8
    python train.py -m model=bert-tiny,bert-mini steps=3     # a two-job sweep
"""

from pipefisher.cli import train_main

if __name__ == "__main__":
    train_main()
