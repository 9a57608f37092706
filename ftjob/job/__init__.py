"""A job's folder and its processes: the folder, the owner lease, the node command and env
(launch), inputs, model files, atomic writes, processes. Imports only ftjob.api."""
