"""Export a run's weights to Hugging Face: ``python export.py from=<run folder or checkpoint> out=<folder>``.

Examples:
    python export.py from=outputs/2026-01-01/12-00-00 out=bert-hf          # the run's final/ weights
    python export.py from=outputs/2026-01-01/12-00-00/checkpoints/step_99 out=bert-step99

Writes config.json, model.safetensors and vocab.txt (``BertForPreTraining.from_pretrained(<folder>)``).
"""

from pipefisher.export import export_main

if __name__ == "__main__":
    export_main()
