"""What a job reads from elsewhere, brought onto the volume before anything trains: the model
and the data, from the Hub (pinned to one commit) or an object store (s3://, one shared copy
per content), with their failures named (sources, s3, storeerrors)."""
