"""klein's extra modes: reference images, masks, image-to-image, previews, LoRA styles."""
