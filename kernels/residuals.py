"""Names of the attention kernels' forward residuals (`jax.ad_checkpoint.checkpoint_name`): the
output and the log-sum-exp. The `save_dots` remat policy keeps them, so the backward pass does not
rerun the forward kernel (`maxtrain.models.stack`). A leaf module: layers import it cheaply."""

RESIDUAL_NAMES = ("attention_out", "attention_lse")
