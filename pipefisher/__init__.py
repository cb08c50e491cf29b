"""pipefisher: pipeline-parallel BERT pretraining with NVLAMB, K-FAC and PipeFisher."""
