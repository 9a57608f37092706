"""ftjob: fine-tune large language models on Kubernetes with one FineTuneJob resource."""

__version__ = "0.1.0"
