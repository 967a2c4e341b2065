"""Pure tensor linear algebra: Cholesky with precise errors, Gram factors, covariance structures, conditioning."""
