"""Sample flows for trying the runner (``flowRef: flowkube_runner.examples.article:ArticleFlow``)."""
