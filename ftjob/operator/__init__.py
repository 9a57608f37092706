"""The Kopf operator: FineTuneJob -> a gang of torchrun pods, and the truth back in status."""
