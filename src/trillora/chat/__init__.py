"""Chat as the policy sees it: messages rendered to tokens with a model's own template, and the
tool calls each family writes parsed back out."""
