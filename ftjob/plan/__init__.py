"""Pure planning: will a job fit, how fast (estimate), what would fit instead (options), the
words (describe), what makes it impossible (limits), the model's shape and the data's size.
Imports only ftjob.api."""
