/* Decode only the part of a JPEG that a crop box keeps, bit for bit as the whole image decodes (convit_scale/jpeg.py).

   A plain C library (no Python API), loaded with ctypes so that numba-compiled FFCV stages can call it as jpeg.py
   calls turbojpeg. libjpeg's defaults, as tjDecompress2 without flags and PIL use them: the accurate integer inverse
   DCT and fancy (triangle-filter) chroma upsampling; output RGB (a greyscale JPEG gives R = G = B, as turbojpeg's
   RGB output and PIL's convert("RGB") do; CMYK is refused, as turbojpeg refuses it).

   What is skipped: the rows above the box (entropy-decoded only: Huffman data cannot be skipped, but no inverse DCT,
   upsampling or colour conversion), the rows below it (not read at all), and the inverse DCT of the iMCU columns
   left and right of it (jpeg_crop_scanline).

   Bit-exactness. Fancy upsampling reads the neighbouring chroma sample on each side, horizontally and (h2v2)
   vertically, and libjpeg treats the edges of a cropped region as image edges (it replicates the edge sample). So
   the region decoded is the box widened by one chroma sample on each side where the image goes on (then aligned
   to iMCU columns by libjpeg), and the box is copied out of it. Rows need no margin: jpeg_skip_scanlines decodes the context rows above the first row output
   (first_row), and the rows below are read as context by libjpeg itself. A progressive JPEG goes the same way (its coefficients are all read before the first row is output, so
   only the inverse DCT is saved); tests/test_jpeg_roi.py compares every case with the whole decode.

   Errors never exit: libjpeg's error_exit longjmps back here. Like turbojpeg, a warning (corrupt data that libjpeg
   decodes anyway) fails the call, but only a warning raised in the part that was read: a JPEG corrupt below the
   box decodes here where the whole decode fails (a prepared .beton holds no such JPEG: prep stores it raw). */

#include <setjmp.h>
#include <sys/mman.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <jpeglib.h>

#define ROI_OK 0
#define ROI_ERROR -1
#define ROI_BAD_BOX -2
#define ROWS_PER_CALL 16

struct roi_error {
  struct jpeg_error_mgr pub;
  jmp_buf escape;
};

static void roi_error_exit(j_common_ptr cinfo) {
  struct roi_error *err = (struct roi_error *)cinfo->err;
  longjmp(err->escape, 1);
}

static void roi_output_message(j_common_ptr cinfo) { (void)cinfo; } /* silent: the caller reports failures */

static uint64_t own_counts[2]; /* calls that decoded a region, calls that failed (-1) */
static uint64_t *counts = own_counts;

/* Count in a MAP_SHARED anonymous page from now on (the counts so far carried over), so that the loader workers this
   process forks count into the same counters: a child inherits the pointer and the mapping, and the atomic adds are
   atomic across processes. The page is never unmapped: a decoding thread may still count while the process exits.
   Returns 0, or -1 (mmap failed: counting stays per process). */
int roi_decode_share_counts(void) {
  if (counts != own_counts)
    return 0;
  void *page = mmap(NULL, 2 * sizeof(uint64_t), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (page == MAP_FAILED)
    return -1;
  uint64_t *shared = (uint64_t *)page;
  shared[0] = __atomic_load_n(&own_counts[0], __ATOMIC_RELAXED);
  shared[1] = __atomic_load_n(&own_counts[1], __ATOMIC_RELAXED);
  __atomic_store_n(&counts, shared, __ATOMIC_RELEASE);
  return 0;
}

/* The counters since the library was loaded (or counted into `shared`): out[0] regions decoded, out[1] failures. */
void roi_decode_counts(uint64_t *out) {
  out[0] = __atomic_load_n(&counts[0], __ATOMIC_RELAXED);
  out[1] = __atomic_load_n(&counts[1], __ATOMIC_RELAXED);
}

/* The first row decoded. libjpeg-turbo 2.1's jpeg_skip_scanlines keeps the context rows of fancy upsampling itself
   (tested: every first row of 4:2:0, 4:2:2 and progressive images, tests/test_jpeg_roi.py), so the box's own first
   row; an older release's skip had bugs there (2.0.x's change log): from the start of the iMCU row above the box's. */
static JDIMENSION first_row(struct jpeg_decompress_struct *cinfo, int y) {
#if defined(LIBJPEG_TURBO_VERSION_NUMBER) && LIBJPEG_TURBO_VERSION_NUMBER >= 2001000
  (void)cinfo;
  return (JDIMENSION)y;
#else
  int imcu_h = cinfo->max_v_samp_factor * DCTSIZE;
  int start = (y / imcu_h - 1) * imcu_h;
  return (JDIMENSION)(start > 0 ? start : 0);
#endif
}

/* Decode the box (x, y, w, h) of the JPEG (jpeg, size) into dst: h rows of w x 3 bytes (RGB), packed. The box must
   lie inside the image (width x height from its header). Returns 0, -1 when libjpeg refuses the data or warns about
   it (dst then holds garbage), -2 for a box outside the image. Thread-safe: all state is the call's own. */
int roi_decode_rgb(const uint8_t *jpeg, size_t size, uint8_t *dst, int x, int y, int w, int h) {
  struct jpeg_decompress_struct cinfo;
  struct roi_error jerr;
  int rc;

  cinfo.err = jpeg_std_error(&jerr.pub);
  jerr.pub.error_exit = roi_error_exit;
  jerr.pub.output_message = roi_output_message;
  /* The escape is set before jpeg_create_decompress, which can fail too (out of memory, or a libjpeg of another
     ABI: a struct size or version it refuses): it clears cinfo.mem before anything that fails, so destroying is
     then a no-op. */
  if (setjmp(jerr.escape)) {
    jpeg_destroy_decompress(&cinfo);
    __atomic_fetch_add(&counts[1], 1, __ATOMIC_RELAXED);
    return ROI_ERROR;
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, jpeg, (unsigned long)size);
  jpeg_read_header(&cinfo, TRUE);
  /* 64-bit sums: x + w and y + h overflow an int for a box far outside any image. */
  if (x < 0 || y < 0 || w < 1 || h < 1 || (int64_t)x + w > (int64_t)cinfo.image_width ||
      (int64_t)y + h > (int64_t)cinfo.image_height) {
    jpeg_destroy_decompress(&cinfo);
    return ROI_BAD_BOX;
  }
  cinfo.out_color_space = JCS_RGB;
  jpeg_start_decompress(&cinfo);

  /* Columns: a margin of one chroma sample (max_h_samp_factor pixels) each side, clamped to the image: the edge
     pixels of the box are then upsampled from their true neighbours, and only the pixels of the margin, which are
     not copied, see the region's edge. libjpeg then moves the offset left to an iMCU boundary and widens the region
     to keep its right edge. */
  int margin = cinfo.max_h_samp_factor;
  int left = x - margin > 0 ? x - margin : 0;
  int right = x + w + margin < (int)cinfo.output_width ? x + w + margin : (int)cinfo.output_width;
  JDIMENSION xoffset = (JDIMENSION)left, width = (JDIMENSION)(right - left);
  if (xoffset > 0 || width < cinfo.output_width)
    jpeg_crop_scanline(&cinfo, &xoffset, &width);

  JDIMENSION start = first_row(&cinfo, y);
  if (start > 0 && jpeg_skip_scanlines(&cinfo, start) != start)
    longjmp(jerr.escape, 1);
  /* Rows are read ROWS_PER_CALL at a time (one row per call costs about 7% of a whole decode) into a buffer of the
     region's width, then the box's columns are copied out. */
  JSAMPARRAY rows = (*cinfo.mem->alloc_sarray)((j_common_ptr)&cinfo, JPOOL_IMAGE, width * 3, ROWS_PER_CALL);
  size_t skip = (size_t)(x - (int)xoffset) * 3, row_bytes = (size_t)w * 3;
  while (cinfo.output_scanline < (JDIMENSION)(y + h)) {
    JDIMENSION r0 = cinfo.output_scanline, want = (JDIMENSION)(y + h) - r0;
    JDIMENSION got = jpeg_read_scanlines(&cinfo, rows, want < ROWS_PER_CALL ? want : ROWS_PER_CALL);
    if (got == 0)
      longjmp(jerr.escape, 1);
    for (JDIMENSION k = 0; k < got; k++)
      if (r0 + k >= (JDIMENSION)y)
        memcpy(dst + (size_t)(r0 + k - y) * row_bytes, rows[k] + skip, row_bytes);
  }
  rc = jerr.pub.num_warnings ? ROI_ERROR : ROI_OK;
  jpeg_abort_decompress(&cinfo); /* the rows below the box are never decoded */
  jpeg_destroy_decompress(&cinfo);
  __atomic_fetch_add(&counts[rc == ROI_OK ? 0 : 1], 1, __ATOMIC_RELAXED);
  return rc;
}
