"""Pure planning: will a job fit, how fast, what would fit instead (estimate), what makes it
impossible (limits), the model's shape and the data's size. Imports only ftjob.api."""
